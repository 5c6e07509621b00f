//! What a store finds on disk: the index rebuilt by scanning (in the
//! background too, serving meanwhile), damaged chunks caught wherever the
//! damage lies and removed, another namespace's chunks unseen, and the fate of
//! every file a get could not serve, named where the store decides it.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{chunk_file, config, counter, fill, open, pattern, payload, wait, T};
use pykvcache::{BackendChoice, FaultPlan, MissKind, StagingPool, Status, VerifyPolicy};

#[test]
fn index_is_rebuilt_from_disk_and_corruption_is_detected_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let keys: Vec<Vec<u8>> = (0..6).map(|i| format!("key-{i}").into_bytes()).collect();
    let paths: Vec<PathBuf>;
    {
        let store = open(config(dir.path(), BackendChoice::IoUring), &pool);
        let a = pool.acquire(T).unwrap();
        for (i, k) in keys.iter().enumerate() {
            fill(&pool, a, 64 << 10, i as u8);
            assert_eq!(wait(&store, store.put(k, a, 64 << 10, T).unwrap()).status, Status::Ok);
        }
        pool.release(a).unwrap();
        paths = keys.iter().map(|k| chunk_file(&store, k)).collect();
    }
    // Damage: a payload bit flip, a truncation, a header edit, a swapped file.
    let flip = |p: &Path, off: u64| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(p).unwrap();
        let mut b = [0u8; 1];
        f.read_at(&mut b, off).unwrap();
        b[0] ^= 0x10;
        f.write_at(&b, off).unwrap();
    };
    flip(&paths[0], 4096 + 777);
    std::fs::OpenOptions::new().write(true).open(&paths[1]).unwrap().set_len(8192).unwrap();
    flip(&paths[2], 40);
    std::fs::copy(&paths[4], &paths[3]).unwrap();

    let store = open(config(dir.path(), BackendChoice::Threads), &pool);
    assert_eq!(store.len(), 6, "index rebuilt by scanning");
    let a = pool.acquire(T).unwrap();
    for (i, k) in keys.iter().enumerate() {
        let o = wait(&store, store.get(k, a, T).unwrap());
        if i < 4 {
            assert_eq!(o.status, Status::Corrupt, "damaged chunk {i} must not be served: {}", o.message);
            assert!(!paths[i].exists(), "corrupt chunk {i} is removed");
        } else {
            assert_eq!(o.status, Status::Ok);
            assert_eq!(payload(&pool, a, 64 << 10), pattern(64 << 10, i as u8));
        }
    }
    assert_eq!(store.len(), 2);
    pool.release(a).unwrap();

    // Another namespace on the same directory sees nothing.
    let mut other = config(dir.path(), BackendChoice::IoUring);
    other.namespace = "another-model".into();
    let other = open(other, &pool);
    assert_eq!(other.len(), 0);
    let a = pool.acquire(T).unwrap();
    assert_eq!(wait(&other, other.get(&keys[4], a, T).unwrap()).status, Status::Miss);
    pool.release(a).unwrap();
}

#[test]
fn a_background_scan_serves_at_once_and_never_revives_what_was_evicted_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let file_len = 4096 + 4096;
    let old: Vec<Vec<u8>> = (0..20).map(|i| format!("old-{i}").into_bytes()).collect();
    {
        let store = open(config(dir.path(), BackendChoice::IoUring), &pool);
        let a = pool.acquire(T).unwrap();
        for (i, k) in old.iter().enumerate() {
            fill(&pool, a, 4096, i as u8);
            assert_eq!(wait(&store, store.put(k, a, 4096, T).unwrap()).status, Status::Ok);
        }
        pool.release(a).unwrap();
    }
    // Hold the scan between walking the tree and merging: the store is observed mid-scan.
    let hold = Arc::new(std::sync::Mutex::new(()));
    let guard = hold.lock().unwrap();
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.background_scan = true;
    c.capacity_bytes = 20 * file_len;
    c.faults = Some(Arc::new(FaultPlan { scan_hold: Some(hold.clone()), ..Default::default() }));
    let store = open(c, &pool);
    assert!(!store.scan_report().done);
    assert_eq!(store.len(), 0, "nothing indexed yet");
    assert!(!store.contains(&old[0]), "an unknown key reads as absent while scanning");
    let a = pool.acquire(T).unwrap();
    let o = wait(&store, store.get(&old[0], a, T).unwrap());
    assert_eq!(o.status, Status::Ok, "get reads the file, not the index: {}", o.message);
    assert_eq!(payload(&pool, a, 4096), pattern(4096, 0));
    assert!(store.probe(&old[1]), "probe finds it on disk and indexes it");
    assert!(store.evict(&old[2]));
    fill(&pool, a, 4096, 99);
    assert_eq!(wait(&store, store.put(b"new", a, 4096, T).unwrap()).status, Status::Ok);
    assert_eq!(store.len(), 3);
    assert!(!store.wait_scan(Some(Duration::from_millis(50))));

    drop(guard);
    assert!(store.wait_scan(T));
    let r = store.scan_report();
    assert!(r.done && r.error.is_none());
    assert_eq!(r.chunks, 17, "the 20 old chunks less the 2 indexed meanwhile and the evicted one");
    assert_eq!(store.len(), 20);
    assert!(!store.contains(&old[2]), "evicted during the scan: not revived");
    assert!(store.contains(&old[3]) && store.contains(b"new"));
    assert_eq!(store.used_bytes(), 20 * file_len);
    // Scanned chunks are less recent than anything used during the scan:
    // the next put evicts the oldest scanned one.
    fill(&pool, a, 4096, 100);
    assert_eq!(wait(&store, store.put(b"newer", a, 4096, T).unwrap()).status, Status::Ok);
    assert!(!store.contains(&old[3]));
    assert!(store.contains(&old[0]) && store.contains(&old[1]) && store.contains(b"new"));
    pool.release(a).unwrap();
}

#[test]
fn closing_during_a_background_scan_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.background_scan = true;
    let store = open(c, &pool);
    store.close();
    assert!(store.scan_report().done);
}

#[test]
fn a_flipped_payload_byte_is_caught_wherever_it_lies() {
    // Reads are checksummed piece by piece as segments land and the pieces
    // combined: every payload byte must be covered exactly once, across piece
    // boundaries, the last 4 KiB (checked after the header is known) and
    // payloads that do or do not fill their last block.
    let seg = 8192;
    for backend in [BackendChoice::IoUring, BackendChoice::Threads] {
        let dir = tempfile::tempdir().unwrap();
        let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
        let mut c = config(dir.path(), backend);
        c.segment_bytes = seg;
        let store = open(c, &pool);
        let (a, b) = (pool.acquire(T).unwrap(), pool.acquire(T).unwrap());
        for len in [1usize, 4096, 3 * seg, 3 * seg + 1000] {
            let file_len = 4096 + len.div_ceil(4096) * 4096;
            let last_sure = (file_len - 4096).saturating_sub(1).max(4096);
            let mut offsets = vec![4096, 4096 + len - 1, last_sure, file_len - 4096, 4096 + len / 2];
            offsets.extend([seg - 1, seg, 2 * seg - 1, 2 * seg, 3 * seg].into_iter().filter(|&o| o >= 4096 && o < 4096 + len));
            offsets.sort_unstable();
            offsets.dedup();
            fill(&pool, a, len, len as u8);
            let clean = format!("clean-{len}");
            assert_eq!(wait(&store, store.put(clean.as_bytes(), a, len, T).unwrap()).status, Status::Ok);
            let o = wait(&store, store.get(clean.as_bytes(), b, T).unwrap());
            assert_eq!(o.status, Status::Ok, "{backend:?} len {len}: {}", o.message);
            assert_eq!(payload(&pool, a, len), payload(&pool, b, len));
            for off in offsets.into_iter().filter(|&o| o >= 4096 && o < 4096 + len) {
                let key = format!("flip-{len}-{off}");
                assert_eq!(wait(&store, store.put(key.as_bytes(), a, len, T).unwrap()).status, Status::Ok);
                let path = chunk_file(&store, key.as_bytes());
                {
                    use std::os::unix::fs::FileExt;
                    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
                    let mut byte = [0u8; 1];
                    f.read_at(&mut byte, off as u64).unwrap();
                    byte[0] ^= 0x01;
                    f.write_at(&byte, off as u64).unwrap();
                }
                let o = wait(&store, store.get(key.as_bytes(), b, T).unwrap());
                assert_eq!(o.status, Status::Corrupt, "{backend:?} len {len}: flip at file offset {off} served: {}", o.message);
            }
        }
        pool.release(a).unwrap();
        pool.release(b).unwrap();
    }
}

#[test]
fn every_get_that_serves_nothing_names_the_fate_of_its_file() {
    // The store alone decides what becomes of a chunk file after a
    // failed read, and says so where it decides; callers never delete one.
    for backend in [BackendChoice::IoUring, BackendChoice::Threads] {
        let dir = tempfile::tempdir().unwrap();
        let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
        let a = pool.acquire(T).unwrap();
        let mut c = config(dir.path(), backend);
        c.verify = VerifyPolicy::Header;
        let header_writer = open(c, &pool);
        fill(&pool, a, 5000, 1);
        assert_eq!(wait(&header_writer, header_writer.put(b"theirs", a, 5000, T).unwrap()).status, Status::Ok);
        drop(header_writer);

        let store = open(config(dir.path(), backend), &pool);
        for (i, key) in [&b"ours"[..], b"fine", b"judged"].into_iter().enumerate() {
            fill(&pool, a, 5000, i as u8);
            let o = wait(&store, store.put(key, a, 5000, T).unwrap());
            assert_eq!((o.status, o.miss_kind), (Status::Ok, None), "{}", o.message);
        }
        let o = wait(&store, store.get(b"ours", a, T).unwrap());
        assert_eq!((o.status, o.miss_kind), (Status::Ok, None));

        let o = wait(&store, store.get(b"never-written", a, T).unwrap());
        assert_eq!((o.status, o.miss_kind, o.errno), (Status::Miss, Some(MissKind::Absent), None));

        let theirs = chunk_file(&store, b"theirs");
        let before = std::fs::read(&theirs).unwrap();
        assert!(store.contains(b"theirs"));
        let o = wait(&store, store.get(b"theirs", a, T).unwrap());
        assert_eq!((o.status, o.miss_kind, o.errno), (Status::Miss, Some(MissKind::Kept), None), "{}", o.message);
        assert_eq!(std::fs::read(&theirs).unwrap(), before, "another writer's chunk is left as it is");
        assert!(store.contains(b"theirs"), "not this store's to evict either");

        let ours = chunk_file(&store, b"ours");
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new().write(true).open(&ours).unwrap();
            f.write_at(&[0xff; 8], 4096 + 100).unwrap();
        }
        let o = wait(&store, store.get(b"ours", a, T).unwrap());
        assert_eq!((o.status, o.miss_kind), (Status::Corrupt, Some(MissKind::Corrupt)), "{}", o.message);
        assert!(!ours.exists() && !store.contains(b"ours"), "removed by the store");

        // The first transfer of a store with a fault plan fails, so the file is
        // not judged: EIO (storage failed) is a miss, EINVAL an error.
        for (key, errno, status) in [(&b"fine"[..], libc::EIO, Status::Miss), (b"judged", libc::EINVAL, Status::Error)] {
            let mut c = config(dir.path(), backend);
            c.faults = Some(Arc::new(FaultPlan { fail_nth: Some((1, errno)), ..Default::default() }));
            let failing = open(c, &pool);
            let o = wait(&failing, failing.get(key, a, T).unwrap());
            assert_eq!((o.status, o.miss_kind, o.errno), (status, Some(MissKind::Unavailable), Some(errno)), "{}", o.message);
            assert!(chunk_file(&failing, key).exists() && failing.contains(key), "untouched, still indexed");
            assert_eq!(wait(&failing, failing.get(key, a, T).unwrap()).status, Status::Ok);
        }
        assert_eq!(counter(&store, "corrupt_chunks"), 1);
        pool.release(a).unwrap();
    }
}
