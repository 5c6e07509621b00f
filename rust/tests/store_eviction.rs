//! A store at its capacity, on real files: least recently used chunks are
//! evicted, a really full filesystem (a 2 MiB tmpfs) evicts on ENOSPC and
//! lowers the capacity, and evicted files are recycled in place for new chunks
//! (one victim per put, from any number of threads), never while another
//! process reads or claims them, never across storage roots.

mod common;

use std::sync::Arc;

use common::{chunk_file, config, counter, fill, inode, lock, mount, open, pattern, payload, round_trip, temp_files, wait, T};
use pykvcache::{BackendChoice, FreeSpaceReserve, OpId, StagingPool, Status};

#[test]
fn capacity_is_enforced_by_lru_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    let file_len = (64 << 10) + 4096;
    c.capacity_bytes = 3 * file_len as u64;
    let store = open(c, &pool);
    let a = pool.acquire(T).unwrap();
    for i in 0..5u8 {
        fill(&pool, a, 64 << 10, i);
        assert_eq!(wait(&store, store.put(&[i], a, 64 << 10, T).unwrap()).status, Status::Ok);
        assert!(store.used_bytes() <= 3 * file_len as u64);
    }
    assert_eq!(store.len(), 3);
    assert!(!store.contains(&[0]) && !store.contains(&[1]));
    assert_eq!(wait(&store, store.get(&[0], a, T).unwrap()).status, Status::Miss);
    assert_eq!(wait(&store, store.get(&[4], a, T).unwrap()).status, Status::Ok);
    pool.release(a).unwrap();
}

#[test]
fn full_filesystem_evicts_on_enospc_and_lowers_the_capacity() {
    // With preallocation fallocate meets the full disk; without, the write does.
    for preallocate in [true, false] {
        full_filesystem_case(preallocate);
    }
}

fn full_filesystem_case(preallocate: bool) {
    let dir = tempfile::tempdir().unwrap();
    let Some(_m) = mount("tmpfs", "size=2m,mode=0700", dir.path()) else { return };
    let pool = Arc::new(StagingPool::create(4 << 20, 2, None).unwrap());
    // Capacity far above the 2 MiB the filesystem holds (tmpfs takes O_DIRECT
    // since Linux 6.6; older kernels run this on the buffered fallback).
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.preallocate = preallocate;
    // No free-space reserve: the filesystem must really fill for ENOSPC to happen.
    c.min_free = FreeSpaceReserve::AtLeast { bytes: 0, fraction: 0.0 };
    let store = open(c, &pool);
    assert!(store.stats().fallbacks().is_empty(), "tmpfs supports fallocate: {:?}", store.stats().fallbacks());
    let a = pool.acquire(T).unwrap();
    let keys: Vec<Vec<u8>> = (0..60).map(|i| format!("fill-{i}").into_bytes()).collect(); // ~4 MiB
    for (i, k) in keys.iter().enumerate() {
        fill(&pool, a, 64 << 10, i as u8);
        let o = wait(&store, store.put(k, a, 64 << 10, T).unwrap());
        assert_eq!(o.status, Status::Ok, "put {i}: ENOSPC must evict and retry: {}", o.message);
    }
    assert_eq!(counter(&store, "write_enospc"), 0, "no put failed");
    assert!(counter(&store, "enospc_retries") >= 1);
    assert!(counter(&store, "enospc_evictions") >= 1);
    assert!(store.capacity_bytes() < 2 << 20, "capacity lowered to what fits: {}", store.capacity_bytes());
    assert_eq!(store.configured_capacity_bytes(), 1 << 30);
    assert!(store.used_bytes() <= store.capacity_bytes());
    let notices = store.take_notices();
    assert_eq!(
        notices.iter().filter(|n| n.level == pykvcache::Level::Warning && n.text.contains("ENOSPC")).count(),
        1,
        "lowering is reported as a warning: {notices:?}"
    );
    assert!(store.take_notices().iter().all(|n| !n.text.contains("ENOSPC")), "reported once");
    // LRU kept the newest chunks, and they hold the right bytes.
    let kept: Vec<usize> = (0..keys.len()).filter(|&i| store.contains(&keys[i])).collect();
    assert!(!kept.is_empty() && kept == ((keys.len() - kept.len())..keys.len()).collect::<Vec<_>>(), "{kept:?}");
    for &i in &kept {
        let o = wait(&store, store.get(&keys[i], a, T).unwrap());
        assert_eq!(o.status, Status::Ok, "{}", o.message);
        assert_eq!(payload(&pool, a, 64 << 10), pattern(64 << 10, i as u8));
    }
    assert!(temp_files(&store).is_empty());

    // A chunk larger than the whole filesystem still fails cleanly, once retried.
    fill(&pool, a, 4 << 20, 6);
    let o = wait(&store, store.put(b"too-big", a, 4 << 20, T).unwrap());
    assert_eq!(o.status, Status::Error);
    assert_eq!(o.errno, Some(libc::ENOSPC), "{}", o.message);
    assert!(!store.contains(b"too-big"));
    assert_eq!(counter(&store, "write_enospc"), 1);
    assert!(temp_files(&store).is_empty(), "nothing leaked");
    pool.release(a).unwrap();
    round_trip(&store, &pool, b"fits-again", 64 << 10, 7);
}

#[test]
fn evicted_files_are_overwritten_in_place_of_new_ones() {
    for backend in [BackendChoice::IoUring, BackendChoice::Threads] {
        let dir = tempfile::tempdir().unwrap();
        let pool = Arc::new(StagingPool::create(128 << 10, 2, None).unwrap());
        let mut c = config(dir.path(), backend);
        c.capacity_bytes = 3 * ((128 << 10) + 4096);
        let store = open(c, &pool);
        let a = pool.acquire(T).unwrap();
        // Each put from the fourth on evicts exactly one chunk; chunk 3 shrinks
        // chunk 0's file (truncated), chunk 6 grows chunk 3's.
        let lens = [128 << 10, 128 << 10, 128 << 10, 5_000, 128 << 10, 128 << 10, 128 << 10];
        let mut inodes = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            fill(&pool, a, len, i as u8);
            let key = [i as u8];
            assert_eq!(wait(&store, store.put(&key, a, len, T).unwrap()).status, Status::Ok);
            let path = chunk_file(&store, &key);
            let file_len = 4096 + (len as u64).div_ceil(4096) * 4096;
            assert_eq!(std::fs::metadata(&path).unwrap().len(), file_len, "no stale tail after reuse");
            inodes.push(inode(&path));
        }
        assert_eq!(counter(&store, "recycled_files"), 4, "each put beyond capacity reuses its victim");
        assert_eq!(counter(&store, "recycle_skipped"), 0);
        assert_eq!(inodes[3..], inodes[..4], "chunk i+3 lives in the file chunk i was evicted from");
        for (i, &len) in lens.iter().enumerate() {
            let o = wait(&store, store.get(&[i as u8], a, T).unwrap());
            if i < 4 {
                assert_eq!(o.status, Status::Miss);
            } else {
                assert_eq!(o.status, Status::Ok, "{}", o.message);
                assert_eq!(payload(&pool, a, len), pattern(len, i as u8));
            }
        }
        assert!(temp_files(&store).is_empty());
        pool.release(a).unwrap();
    }
}

#[test]
fn concurrent_puts_at_capacity_each_recycle_their_own_victim() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(256 << 10, 8, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.capacity_bytes = 8 * ((256 << 10) + 4096);
    let store = open(c, &pool);
    let slots: Vec<usize> = (0..8).map(|_| pool.acquire(T).unwrap()).collect();
    for round in 0..2u8 {
        // All eight in flight at once: in-flight bytes are reserved, so each
        // put evicts one chunk instead of all seeing the same free space.
        let ids: Vec<OpId> = slots
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                fill(&pool, s, 256 << 10, round * 8 + i as u8);
                store.put(&[round, i as u8], s, 256 << 10, T).unwrap()
            })
            .collect();
        for id in ids {
            assert_eq!(wait(&store, id).status, Status::Ok);
        }
        assert!(store.used_bytes() <= store.capacity_bytes());
    }
    assert_eq!(counter(&store, "evictions"), 8);
    assert_eq!(counter(&store, "recycled_files"), 8);
    for (i, &s) in slots.iter().enumerate() {
        assert_eq!(wait(&store, store.get(&[0, i as u8], s, T).unwrap()).status, Status::Miss);
        assert_eq!(wait(&store, store.get(&[1, i as u8], s, T).unwrap()).status, Status::Ok);
        assert_eq!(payload(&pool, s, 256 << 10), pattern(256 << 10, 8 + i as u8));
    }
    assert!(temp_files(&store).is_empty());
    for s in slots {
        pool.release(s).unwrap();
    }
}

#[test]
fn puts_from_many_threads_at_capacity_never_share_a_victim() {
    // Puts from several threads at once (vLLM's worker and preload threads,
    // a benchmark's submitters) each choose their victims. Two that chose the
    // same least recently used chunk used to both "evict" it: one recycled its
    // file, the other found nothing to claim, wrote a fresh file uncounted and
    // left the store over capacity until a trim. Victims are now taken out of
    // the index where they are chosen, so every put beyond capacity evicts and
    // claims exactly one file of its own.
    const THREADS: usize = 8;
    const PUTS: usize = 250;
    const LEN: usize = 4 << 10;
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(LEN, THREADS, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    // Room for more chunks than puts in flight: each put finds a victim.
    c.capacity_bytes = 16 * (LEN as u64 + 4096);
    let store = Arc::new(open(c, &pool));
    for i in 0..16u8 {
        round_trip(&store, &pool, &[0xff, i], LEN, i);
    }
    let barrier = Arc::new(std::sync::Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (store, pool, barrier) = (store.clone(), pool.clone(), barrier.clone());
            std::thread::spawn(move || {
                let a = pool.acquire(T).unwrap();
                for i in 0..PUTS {
                    fill(&pool, a, LEN, (t * PUTS + i) as u8);
                    barrier.wait();
                    let o = wait(&store, store.put(&[t as u8, i as u8], a, LEN, T).unwrap());
                    assert_eq!(o.status, Status::Ok, "{}", o.message);
                }
                pool.release(a).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let puts = (THREADS * PUTS) as u64;
    let (recycled, skipped) = (counter(&store, "recycled_files"), counter(&store, "recycle_skipped"));
    assert_eq!(recycled + skipped, puts, "every put beyond capacity claims (or skips) a victim of its own");
    assert_eq!(skipped, 0, "nobody reads here, so no victim is locked");
    assert_eq!(counter(&store, "evictions"), puts);
    assert!(store.used_bytes() <= store.capacity_bytes());
    assert!(temp_files(&store).is_empty());
}

#[test]
fn recycling_can_be_turned_off() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.capacity_bytes = (64 << 10) + 4096;
    c.recycle_files = false;
    let store = open(c, &pool);
    round_trip(&store, &pool, b"one", 64 << 10, 1);
    round_trip(&store, &pool, b"two", 64 << 10, 2);
    assert_eq!(counter(&store, "evictions"), 1);
    assert_eq!(counter(&store, "recycled_files"), 0);
}

#[test]
fn a_file_being_read_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.capacity_bytes = (64 << 10) + 4096;
    let store = open(c, &pool);
    let a = pool.acquire(T).unwrap();
    fill(&pool, a, 64 << 10, 1);
    assert_eq!(wait(&store, store.put(b"held", a, 64 << 10, T).unwrap()).status, Status::Ok);
    let path = chunk_file(&store, b"held");
    let before = std::fs::read(&path).unwrap();
    let reader = lock(&path, libc::LOCK_SH);
    fill(&pool, a, 64 << 10, 2);
    assert_eq!(wait(&store, store.put(b"next", a, 64 << 10, T).unwrap()).status, Status::Ok);
    assert_eq!(counter(&store, "recycle_skipped"), 1, "a locked victim is not claimed");
    assert_eq!(counter(&store, "recycled_files"), 0);
    assert!(!path.exists(), "the victim is still evicted");
    let mut after = Vec::new();
    use std::io::{Read, Seek};
    let mut r = reader;
    r.seek(std::io::SeekFrom::Start(0)).unwrap();
    r.read_to_end(&mut after).unwrap();
    assert_eq!(after, before, "the open reader still sees the old chunk, unchanged");
    assert!(temp_files(&store).is_empty());
    let o = wait(&store, store.get(b"next", a, T).unwrap());
    assert_eq!(o.status, Status::Ok);
    pool.release(a).unwrap();
}

#[test]
fn a_chunk_locked_by_a_recycler_is_a_miss_not_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let store = open(config(dir.path(), BackendChoice::IoUring), &pool);
    let a = pool.acquire(T).unwrap();
    fill(&pool, a, 64 << 10, 1);
    assert_eq!(wait(&store, store.put(b"k", a, 64 << 10, T).unwrap()).status, Status::Ok);
    let path = chunk_file(&store, b"k");
    // Another process claiming it holds the exclusive lock while it overwrites.
    let recycler = lock(&path, libc::LOCK_EX);
    let o = wait(&store, store.get(b"k", a, T).unwrap());
    assert_eq!(o.status, Status::Miss, "{}", o.message);
    assert_eq!(counter(&store, "corrupt_chunks"), 0);
    assert!(path.exists(), "a miss removes nothing");
    drop(recycler);
    assert!(store.probe(b"k"));
    assert_eq!(wait(&store, store.get(b"k", a, T).unwrap()).status, Status::Ok);
    pool.release(a).unwrap();
}

#[test]
fn a_victim_on_another_root_is_unlinked_not_moved() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let mut c = config(d1.path(), BackendChoice::IoUring);
    c.dirs.push(d2.path().to_path_buf());
    c.capacity_bytes = (64 << 10) + 4096;
    let store = open(c, &pool);
    let a = pool.acquire(T).unwrap();
    let roots = |k: &[u8]| (pykvcache::key_hash(k) >> 64) as u64 % 2;
    let keys: Vec<Vec<u8>> = (0..12u8).map(|i| vec![i]).collect();
    let mut same = 0;
    for (i, k) in keys.iter().enumerate() {
        fill(&pool, a, 64 << 10, i as u8);
        assert_eq!(wait(&store, store.put(k, a, 64 << 10, T).unwrap()).status, Status::Ok);
        if i > 0 && roots(k) == roots(&keys[i - 1]) {
            same += 1;
        }
    }
    assert_eq!(counter(&store, "recycled_files"), same, "only victims on the writer's root are reused");
    assert!(same > 0 && same < 11, "both cases occur with these keys ({same})");
    assert_eq!(counter(&store, "evictions"), 11);
    assert_eq!(store.len(), 1);
    let o = wait(&store, store.get(&keys[11], a, T).unwrap());
    assert_eq!(o.status, Status::Ok);
    pool.release(a).unwrap();
}
