//! `capacity_bytes` bounds a storage directory, whatever namespaces and
//! writers share it (decision 0053): real files, real io_uring.
//! - an old namespace's chunks count against a new namespace's capacity and
//!   the stalest go first, while lookups stay per namespace;
//! - two stores writing one local directory with the default refresh end
//!   within one capacity in total, and each one's index matches the disk;
//! - two and four writers at full speed or paced never hold more than 1.1x
//!   the capacity, sampled while they write and after each close.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pykvcache::{chunk_file_bytes, BlockStore, OpId, StagingPool, Status, StoreConfig};

const T: Option<Duration> = Some(Duration::from_secs(30));
const PAYLOAD: usize = 60 << 10;

fn file_len() -> u64 {
    chunk_file_bytes(PAYLOAD) as u64
}

fn config(dir: &Path, namespace: &str, chunks: u64) -> StoreConfig {
    let mut c = StoreConfig::new(vec![dir.to_path_buf()], namespace, chunks * file_len());
    // Only the capacity evicts here, never the free-space reserve of the test machine's disk.
    c.min_free = pykvcache::FreeSpaceReserve::AtLeast { bytes: 0, fraction: 0.0 };
    c
}

fn wait(store: &BlockStore, id: OpId) -> pykvcache::Outcome {
    let o = store.wait(id, T).unwrap().expect("operation timed out");
    store.release_op(id);
    o
}

fn try_put(store: &BlockStore, pool: &StagingPool, key: &[u8]) -> pykvcache::Outcome {
    let slot = pool.acquire(T).unwrap();
    // SAFETY: `slot` is leased here, PAYLOAD fits its payload, and no operation uses it yet.
    let p = unsafe { std::slice::from_raw_parts_mut(pool.payload_ptr(slot), PAYLOAD) };
    p.fill(key[key.len() - 1]);
    let o = wait(store, store.put(key, slot, PAYLOAD, T).unwrap());
    pool.release(slot).unwrap();
    o
}

fn put(store: &BlockStore, pool: &StagingPool, key: &[u8]) {
    let o = try_put(store, pool, key);
    assert_eq!(o.status, Status::Ok, "{}", o.message);
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

/// Chunk files under `root`, by namespace directory (any namespace).
fn chunks_on_disk(root: &Path) -> Vec<(String, PathBuf, u64)> {
    let mut out = Vec::new();
    for ns in std::fs::read_dir(root).unwrap().flatten() {
        if !ns.file_type().unwrap().is_dir() {
            continue;
        }
        let ns_name = ns.file_name().to_string_lossy().into_owned();
        for shard in std::fs::read_dir(ns.path()).unwrap().flatten() {
            if !shard.file_type().unwrap().is_dir() {
                continue;
            }
            for f in std::fs::read_dir(shard.path()).unwrap().flatten() {
                if f.file_name().to_string_lossy().ends_with(".kvc") {
                    out.push((ns_name.clone(), f.path(), f.metadata().unwrap().len()));
                }
            }
        }
    }
    out
}

fn bytes_on_disk(root: &Path) -> u64 {
    chunks_on_disk(root).iter().map(|(_, _, len)| len).sum()
}

fn ns_dir_name(store: &BlockStore) -> String {
    store.namespace_dirs()[0].file_name().unwrap().to_string_lossy().into_owned()
}

fn key(prefix: &str, i: usize) -> Vec<u8> {
    format!("{prefix}-{i:03}").into_bytes()
}

#[test]
fn a_new_namespace_evicts_the_stalest_chunks_of_an_old_one_within_one_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(PAYLOAD, 2, None).unwrap());
    // The old namespace (another model, dtype or override) fills 6 of 8 chunks' capacity.
    let old_ns;
    {
        let old = BlockStore::open(config(dir.path(), "model-v1", 8), pool.clone()).unwrap().0;
        old_ns = ns_dir_name(&old);
        for i in 0..6 {
            put(&old, &pool, &key("k", i));
            std::thread::sleep(Duration::from_millis(5)); // distinct modification times
        }
        old.close();
    }
    // The new namespace: same keys, same capacity, same root.
    let new = BlockStore::open(config(dir.path(), "model-v2", 8), pool.clone()).unwrap().0;
    let new_ns = ns_dir_name(&new);
    for i in 0..6 {
        assert!(!new.contains(&key("k", i)) && !new.probe(&key("k", i)), "another namespace's chunk is no hit");
        assert_eq!(get(&new, &pool, &key("k", i)), Status::Miss);
    }
    for i in 0..6 {
        put(&new, &pool, &key("k", i));
    }
    let on_disk = chunks_on_disk(dir.path());
    let total: u64 = on_disk.iter().map(|(_, _, l)| l).sum();
    assert!(total <= 8 * file_len(), "{total} bytes on disk for a capacity of {}: {on_disk:?}", 8 * file_len());
    // Every chunk of the new namespace is kept; the old one keeps its 2 most recent.
    let mut old_left: Vec<String> =
        on_disk.iter().filter(|(ns, _, _)| *ns == old_ns).map(|(_, p, _)| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(on_disk.iter().filter(|(ns, _, _)| *ns == new_ns).count(), 6);
    old_left.sort();
    let mut expect: Vec<String> = (4..6).map(|i| format!("{:032x}.kvc", pykvcache::key_hash(&key("k", i)))).collect();
    expect.sort();
    assert_eq!(old_left, expect, "the stalest chunks of the old namespace went first");
    for i in 0..6 {
        assert_eq!(get(&new, &pool, &key("k", i)), Status::Ok);
    }
    assert_eq!((new.len(), new.used_bytes()), (6, 6 * file_len()), "this namespace's own chunks");
    // The old namespace, opened again, serves what is left of it and no byte of the new one.
    new.close();
    let old = BlockStore::open(config(dir.path(), "model-v1", 8), pool.clone()).unwrap().0;
    assert_eq!(old.len(), 2);
    assert_eq!(get(&old, &pool, &key("k", 5)), Status::Ok);
    assert_eq!(get(&old, &pool, &key("k", 0)), Status::Miss);
}

/// Two stores of the given namespaces writing one local directory with the
/// default configuration (no refresh interval set) at once.
fn two_writers(ns_a: &str, ns_b: &str) {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(PAYLOAD, 4, None).unwrap());
    let capacity = 10;
    let a = BlockStore::open(config(dir.path(), ns_a, capacity), pool.clone()).unwrap().0;
    let b = BlockStore::open(config(dir.path(), ns_b, capacity), pool.clone()).unwrap().0;
    for i in 0..12 {
        put(&a, &pool, &key("a", i));
        put(&b, &pool, &key("b", i));
    }
    // Within a few refreshes the directory is back within one capacity and
    // each index holds what is on disk of its namespace.
    let limit = capacity * file_len();
    let settled = |s: &BlockStore| {
        let mine: Vec<_> = chunks_on_disk(dir.path()).into_iter().filter(|(ns, _, _)| *ns == ns_dir_name(s)).collect();
        (s.len(), s.used_bytes()) == (mine.len(), mine.iter().map(|(_, _, l)| l).sum())
    };
    let until = Instant::now() + Duration::from_secs(15);
    while !(bytes_on_disk(dir.path()) <= limit && settled(&a) && settled(&b)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let total = bytes_on_disk(dir.path());
    assert!(total <= limit, "{ns_a}/{ns_b}: {total} bytes on disk for a shared capacity of {limit}");
    for s in [&a, &b] {
        assert!(settled(s), "{ns_a}/{ns_b}: index {} chunks, {} bytes; disk {:?}", s.len(), s.used_bytes(), chunks_on_disk(dir.path()));
    }
    // Each still serves its most recent chunks.
    assert_eq!(get(&a, &pool, &key("a", 11)), Status::Ok);
    assert_eq!(get(&b, &pool, &key("b", 11)), Status::Ok);
}

#[test]
fn two_writers_of_one_namespace_share_one_capacity_by_default() {
    two_writers("shared-ns", "shared-ns");
}

#[test]
fn two_writers_of_two_namespaces_share_one_capacity_by_default() {
    two_writers("ns-one", "ns-two");
}

/// Bytes of every file in the namespace directories under `root` (chunks and
/// visible temporary files): what the writers hold on disk. Each inode once:
/// a file renamed during the walk (a victim claimed for reuse) is not two.
fn held_bytes(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let Ok(namespaces) = std::fs::read_dir(root) else { return 0 };
    for ns in namespaces.flatten() {
        if !ns.file_type().map(|t| t.is_dir()).unwrap_or(false) || ns.file_name() == ".writers" {
            continue;
        }
        for shard in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            for f in std::fs::read_dir(shard.path()).into_iter().flatten().flatten() {
                if let Ok(m) = f.metadata() {
                    if m.is_file() && seen.insert(m.ino()) {
                        total += m.len();
                    }
                }
            }
        }
    }
    total
}

/// `writers` stores of their own namespaces write one directory at once for
/// `seconds`, each at `rate` bytes/s (None: as fast as it can), then all close
/// together. Returns (peak sampled at 20 Hz while they wrote, bytes after the
/// closes, chunks written in all, puts skipped in all).
fn many_writers(writers: usize, rate: Option<f64>, seconds: f64, capacity: u64) -> (u64, u64, usize, usize) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let peak = std::sync::atomic::AtomicU64::new(0);
    let written = std::sync::atomic::AtomicUsize::new(0);
    let skipped = std::sync::atomic::AtomicUsize::new(0);
    let barrier = std::sync::Barrier::new(writers);
    std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(held_bytes(&root), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let handles: Vec<_> = (0..writers)
            .map(|w| {
                let (root, barrier, written, skipped) = (&root, &barrier, &written, &skipped);
                s.spawn(move || {
                    let pool = Arc::new(StagingPool::create(PAYLOAD, 2, None).unwrap());
                    let mut c = config(root, &format!("writer-{w}"), 0);
                    c.capacity_bytes = capacity;
                    let store = BlockStore::open(c, pool.clone()).unwrap().0;
                    barrier.wait();
                    let t0 = Instant::now();
                    let (mut i, mut refused) = (0, 0);
                    while t0.elapsed().as_secs_f64() < seconds {
                        // A put may be skipped (counted) while the room is held by
                        // chunks this writer has not walked yet; never an error.
                        let o = try_put(&store, &pool, &key(&format!("w{w}"), i));
                        match o.status {
                            Status::Ok => {}
                            _ if o.errno == Some(libc::EAGAIN) => refused += 1,
                            _ => panic!("put failed: {}", o.message),
                        }
                        i += 1;
                        if let Some(rate) = rate {
                            let due = Duration::from_secs_f64(i as f64 * file_len() as f64 / rate);
                            if let Some(wait) = due.checked_sub(t0.elapsed()) {
                                std::thread::sleep(wait);
                            }
                        }
                    }
                    written.fetch_add(i - refused, std::sync::atomic::Ordering::Relaxed);
                    skipped.fetch_add(refused, std::sync::atomic::Ordering::Relaxed);
                    // All close together: nobody walks after the others are gone.
                    barrier.wait();
                    store.close();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        sampler.join().unwrap();
    });
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed).max(held_bytes(&root));
    let load = |a: &std::sync::atomic::AtomicUsize| a.load(std::sync::atomic::Ordering::Relaxed);
    (peak, held_bytes(&root), load(&written), load(&skipped))
}

#[test]
fn two_and_four_writers_never_hold_more_than_a_tenth_over_the_capacity() {
    // 8 MiB as in the report that found 2.0x: 128 chunks of 64 KiB.
    let capacity = 128 * file_len();
    let bound = capacity + capacity / 10;
    for (writers, rate, seconds) in [(2, None, 1.0), (4, None, 1.0), (2, Some(5e6), 2.0), (4, Some(5e6), 2.0)] {
        let (peak, after, written, skipped) = many_writers(writers, rate, seconds, capacity);
        let what = format!("{writers} writers at {rate:?} B/s: {written} chunks written, {skipped} skipped");
        assert!(skipped * 50 <= written, "{what}: more than 2% of the puts skipped");
        eprintln!("{what}: peak {:.3}x, after the closes {:.3}x", peak as f64 / capacity as f64, after as f64 / capacity as f64);
        assert!(written as u64 * file_len() > capacity * 3 / 2, "{what}: the capacity was not under pressure");
        assert!(
            peak <= bound,
            "{what}: {peak} bytes held at the peak for a capacity of {capacity} ({:.2}x)",
            peak as f64 / capacity as f64
        );
        assert!(after <= bound, "{what}: {after} bytes left after the closes for a capacity of {capacity}");
    }
}
