//! A storage directory deleted, moved away or replaced under a running store
//! (a cleanup job, an operator): real files, real io_uring. While it is gone
//! the directory is unavailable (puts skipped and counted, its breaker open)
//! and nothing re-creates it; once a directory is back at its path the store
//! works again within seconds, its index rebuilt from what is there.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{wait, T};
use pykvcache::{chunk_file_bytes, BlockStore, StagingPool, Status, StoreConfig};

const PAYLOAD: usize = 60 << 10;
/// What the store promises after the directory's return.
const BACK_WITHIN: Duration = Duration::from_secs(10);

fn config(dir: &Path) -> StoreConfig {
    let mut c = StoreConfig::new(vec![dir.to_path_buf()], "vanishing", 64 * chunk_file_bytes(PAYLOAD) as u64);
    c.min_free = pykvcache::FreeSpaceReserve::AtLeast { bytes: 0, fraction: 0.0 };
    c
}

fn put(store: &BlockStore, pool: &StagingPool, key: &[u8]) -> pykvcache::Outcome {
    let slot = pool.acquire(T).unwrap();
    // SAFETY: `slot` is leased here, PAYLOAD fits its payload, and no operation uses it yet.
    let p = unsafe { std::slice::from_raw_parts_mut(pool.payload_ptr(slot), PAYLOAD) };
    p.fill(key[key.len() - 1]);
    let o = wait(store, store.put(key, slot, PAYLOAD, T).unwrap());
    pool.release(slot).unwrap();
    o
}

fn get(store: &BlockStore, pool: &StagingPool, key: &[u8]) -> Status {
    let slot = pool.acquire(T).unwrap();
    let o = wait(store, store.get(key, slot, T).unwrap());
    if o.status == Status::Ok {
        // SAFETY: `slot` is leased here, PAYLOAD fits its payload, and its get has completed.
        let p = unsafe { std::slice::from_raw_parts(pool.payload_ptr(slot), PAYLOAD) };
        assert!(p.iter().all(|&b| b == key[key.len() - 1]), "served another chunk's bytes for {key:?}");
    }
    pool.release(slot).unwrap();
    o.status
}

fn health(store: &BlockStore, name: &str) -> u64 {
    store.snapshot().health.iter().find(|(n, _)| *n == name).unwrap().1
}

/// Puts `key` until one succeeds; the time it took.
fn put_until_ok(store: &BlockStore, pool: &StagingPool, key: &[u8]) -> Duration {
    let t0 = Instant::now();
    loop {
        let o = put(store, pool, key);
        if o.status == Status::Ok {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < BACK_WITHIN * 2, "no put succeeds after the directory came back: {}", o.message);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The index, once the walk that follows a directory's return is done: (chunks, bytes).
fn settled_index(store: &BlockStore, want: usize) -> (usize, u64) {
    let until = Instant::now() + Duration::from_secs(2);
    while store.len() != want && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    (store.len(), store.used_bytes())
}

/// Puts while the root is gone: skipped or failed, never creating anything.
fn puts_while_gone(store: &BlockStore, pool: &StagingPool, root: &Path, n: usize) {
    for i in 0..n {
        let o = put(store, pool, format!("gone-{i:03}").as_bytes());
        assert_ne!(o.status, Status::Ok, "a put succeeded into a deleted directory");
        std::thread::sleep(Duration::from_millis(100));
        assert!(!root.exists(), "the store re-created its deleted root {}", root.display());
    }
}

#[test]
fn a_deleted_root_is_unavailable_never_recreated_and_works_again_once_recreated() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("kv");
    let pool = Arc::new(StagingPool::create(PAYLOAD, 2, None).unwrap());
    let store = BlockStore::open(config(&root), pool.clone()).unwrap().0;
    for i in 0..4 {
        assert_eq!(put(&store, &pool, format!("old-{i:03}").as_bytes()).status, Status::Ok);
    }
    std::fs::remove_dir_all(&root).unwrap();
    // 3 s of puts (a breaker probe every second or so meanwhile): none lands, nothing re-created.
    puts_while_gone(&store, &pool, &root, 30);
    let s = store.snapshot();
    assert_ne!(s.dir_states, vec!["closed"], "the directory's breaker watches it while it is gone (open, or half-open: probing)");
    assert!(health(&store, "breaker_skipped_puts") > 20, "{:?}", s.health);
    assert_eq!(get(&store, &pool, b"old-000"), Status::Miss);

    // An operator re-creates the directory (a new inode at the same path).
    std::fs::create_dir(&root).unwrap();
    let back = put_until_ok(&store, &pool, b"new-000");
    assert!(back <= BACK_WITHIN, "stores resumed {back:?} after the directory came back");
    assert_eq!(get(&store, &pool, b"new-000"), Status::Ok);
    assert_eq!(get(&store, &pool, b"old-001"), Status::Miss, "the old chunks went with the old directory");
    // The index holds what is there: the new chunk, not the 4 deleted ones.
    assert_eq!(settled_index(&store, 1), (1, chunk_file_bytes(PAYLOAD) as u64));
    assert_eq!(store.snapshot().dir_states, vec!["closed"]);
    for i in 1..6 {
        assert_eq!(put(&store, &pool, format!("new-{i:03}").as_bytes()).status, Status::Ok);
    }
    assert_eq!(store.len(), 6);
}

#[test]
fn a_root_moved_away_and_back_serves_its_chunks_again() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("kv");
    let aside = tmp.path().join("kv-aside");
    let pool = Arc::new(StagingPool::create(PAYLOAD, 2, None).unwrap());
    let store = BlockStore::open(config(&root), pool.clone()).unwrap().0;
    for i in 0..4 {
        assert_eq!(put(&store, &pool, format!("kept-{i:03}").as_bytes()).status, Status::Ok);
    }
    std::fs::rename(&root, &aside).unwrap();
    puts_while_gone(&store, &pool, &root, 15);
    assert_ne!(store.snapshot().dir_states, vec!["closed"]);
    assert!(health(&store, "breaker_skipped_puts") > 10);
    assert_eq!(get(&store, &pool, b"kept-000"), Status::Miss);
    std::fs::rename(&aside, &root).unwrap();
    let back = put_until_ok(&store, &pool, b"kept-new");
    assert!(back <= BACK_WITHIN, "stores resumed {back:?} after the directory came back");
    // The index was rebuilt from the directory: its 4 chunks and the new one.
    for i in 0..4 {
        assert_eq!(get(&store, &pool, format!("kept-{i:03}").as_bytes()), Status::Ok);
    }
    assert_eq!(settled_index(&store, 5).0, 5);
}

#[test]
fn a_namespace_directory_deleted_under_a_root_that_stays_is_rebuilt() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("kv");
    let pool = Arc::new(StagingPool::create(PAYLOAD, 2, None).unwrap());
    let store = BlockStore::open(config(&root), pool.clone()).unwrap().0;
    assert_eq!(put(&store, &pool, b"a-000").status, Status::Ok);
    // A cleanup job empties the root (the root itself stays).
    std::fs::remove_dir_all(&store.namespace_dirs()[0]).unwrap();
    let back = put_until_ok(&store, &pool, b"a-001");
    assert!(back <= BACK_WITHIN, "stores resumed {back:?} after the namespace directory went");
    assert_eq!(get(&store, &pool, b"a-001"), Status::Ok);
    assert_eq!(settled_index(&store, 1).0, 1, "the index holds what is there");
}
