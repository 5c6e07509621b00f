//! Store tests on real files with the real backends (no mocks): round trips,
//! forced short I/O, injected EIO, a real full filesystem, eviction, index
//! rebuild, corruption, and the buffered fallback on a filesystem that refuses
//! O_DIRECT.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use pykvcache::{
    BackendChoice, BlockStore, DirectIoPolicy, FaultPlan, FreeSpaceReserve, MissKind, OpId, StagingPool, Status, StoreConfig, VerifyPolicy,
};

const T: Option<Duration> = Some(Duration::from_secs(30));

fn config(dir: &Path, backend: BackendChoice) -> StoreConfig {
    let mut c = StoreConfig::new(vec![dir.to_path_buf()], "test-namespace", 1 << 30);
    c.backend = backend;
    // Small segments in both directions: multi-segment transfers, partial
    // last segments and per-segment faults are exercised everywhere.
    c.segment_bytes = 64 << 10;
    c.write_segment_bytes = 64 << 10;
    c
}

fn open(c: StoreConfig, pool: &Arc<StagingPool>) -> BlockStore {
    BlockStore::open(c, pool.clone()).expect("open store").0
}

fn fill(pool: &StagingPool, slot: usize, len: usize, seed: u8) {
    // SAFETY: the tests fill slots they leased, `len` within the slot size, while no operation uses
    // them.
    let p = unsafe { std::slice::from_raw_parts_mut(pool.payload_ptr(slot), len) };
    for (i, b) in p.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

fn payload(pool: &StagingPool, slot: usize, len: usize) -> Vec<u8> {
    // SAFETY: the tests read slots they leased, `len` within the slot size, after their operations
    // completed.
    unsafe { std::slice::from_raw_parts(pool.payload_ptr(slot), len) }.to_vec()
}

fn wait(store: &BlockStore, id: OpId) -> pykvcache::Outcome {
    let o = store.wait(id, T).unwrap().expect("operation timed out");
    store.release_op(id);
    o
}

fn round_trip(store: &BlockStore, pool: &StagingPool, key: &[u8], len: usize, seed: u8) {
    let a = pool.acquire(T).unwrap();
    let b = pool.acquire(T).unwrap();
    fill(pool, a, len, seed);
    let o = wait(store, store.put(key, a, len, T).unwrap());
    assert_eq!(o.status, Status::Ok, "{}", o.message);
    let o = wait(store, store.get(key, b, T).unwrap());
    assert_eq!(o.status, Status::Ok, "{}", o.message);
    assert_eq!(o.length, len as u64);
    assert_eq!(payload(pool, a, len), payload(pool, b, len));
    pool.release(a).unwrap();
    pool.release(b).unwrap();
}

#[test]
fn every_backend_round_trips_multi_segment_chunks() {
    let cases = [
        (BackendChoice::IoUring, true, 0, true),
        (BackendChoice::IoUring, false, 64 << 10, false),
        (BackendChoice::Threads, false, 0, true),
    ];
    for (backend, fixed, write_segment, preallocate) in cases {
        let dir = tempfile::tempdir().unwrap();
        let pool = Arc::new(StagingPool::create(3 << 20, 4, None).unwrap());
        let mut c = config(dir.path(), backend);
        c.register_buffers = fixed;
        c.preallocate = preallocate;
        // 0: the default, each chunk written in one transfer.
        c.write_segment_bytes = write_segment;
        let store = open(c, &pool);
        assert_eq!(store.fixed_buffers(), fixed);
        assert!(store.direct_io(), "ext4/tmp supports O_DIRECT here");
        // Odd length: exercises payload padding and a partial last segment.
        round_trip(&store, &pool, b"chunk-a", (3 << 20) - 12345, 1);
        round_trip(&store, &pool, b"chunk-b", 1, 2);
        assert_eq!(store.len(), 2);
    }
}

#[test]
fn short_transfers_are_resubmitted_until_complete() {
    for backend in [BackendChoice::IoUring, BackendChoice::Threads] {
        // A whole-chunk write (the default) cut short is resubmitted the same way.
        for write_segment in [64 << 10, 0] {
            let dir = tempfile::tempdir().unwrap();
            let pool = Arc::new(StagingPool::create(1 << 20, 2, None).unwrap());
            let mut c = config(dir.path(), backend);
            c.write_segment_bytes = write_segment;
            c.faults = Some(Arc::new(FaultPlan { max_transfer: Some(12288), ..Default::default() }));
            let store = open(c, &pool);
            round_trip(&store, &pool, b"short-io", 1 << 20, 9);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(1 << 20, 2, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.write_segment_bytes = 1000;
    let err = BlockStore::open(c, pool).err().expect("unaligned write segment refused");
    assert!(err.to_string().contains("write_segment_bytes"), "{err}");
}

#[test]
fn injected_eio_fails_the_operation_and_nothing_else() {
    for backend in [BackendChoice::IoUring, BackendChoice::Threads] {
        let dir = tempfile::tempdir().unwrap();
        let pool = Arc::new(StagingPool::create(256 << 10, 2, None).unwrap());
        let mut c = config(dir.path(), backend);
        c.faults = Some(Arc::new(FaultPlan { fail_nth: Some((2, libc::EIO)), ..Default::default() }));
        let store = open(c, &pool);
        let a = pool.acquire(T).unwrap();
        fill(&pool, a, 256 << 10, 3);
        let o = wait(&store, store.put(b"eio", a, 256 << 10, T).unwrap());
        assert_eq!(o.status, Status::Error);
        assert_eq!(o.errno, Some(libc::EIO));
        assert!(!store.contains(b"eio"), "a failed write must not become visible");
        pool.release(a).expect("slot unpinned after a failed operation");
        round_trip(&store, &pool, b"after-eio", 256 << 10, 4);
    }
}

#[test]
fn a_failed_ring_fails_pending_operations_and_refuses_new_ones() {
    // A fatal io_uring_enter error panicked the ring thread
    // (every later operation hung). Now what is pending fails with an error,
    // the backend reports itself dead, and new work is refused.
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(1 << 20, 3, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.queue_depth = 2; // 17 segments per chunk: most of them wait in the overflow
    let faults = Arc::new(FaultPlan::default());
    c.faults = Some(faults.clone());
    let store = open(c, &pool);
    if store.backend_name() != "io_uring" {
        eprintln!("io_uring unavailable here: skipped");
        return;
    }
    let (a, b, d) = (pool.acquire(T).unwrap(), pool.acquire(T).unwrap(), pool.acquire(T).unwrap());
    fill(&pool, a, 1 << 20, 9);
    assert_eq!(wait(&store, store.put(b"k", a, 1 << 20, T).unwrap()).status, Status::Ok);
    assert_eq!(store.backend_failure(), None);

    faults.fail_next_enter(libc::EFAULT);
    let get = store.get(b"k", b, T).unwrap();
    let prefetch = store.prefetch(b"k", d, T);
    for id in std::iter::once(get).chain(prefetch.ok()) {
        let o = wait(&store, id);
        assert_eq!(o.status, Status::Error, "{}", o.message);
        assert_eq!(o.errno, Some(libc::EFAULT));
        assert!(o.message.contains("the I/O backend failed"), "{}", o.message);
    }
    let why = store.backend_failure().expect("the backend reports its failure");
    assert!(why.contains("io_uring_enter failed"), "{why}");
    let refused = store.get(b"k", b, T).unwrap_err();
    assert!(matches!(refused, pykvcache::EngineError::BackendUnavailable(_)), "{refused}");
    assert!(matches!(store.put(b"k2", a, 4096, T), Err(pykvcache::EngineError::BackendUnavailable(_))));
    for s in [a, b, d] {
        pool.release(s).expect("every slot unpinned");
    }
    assert_eq!(store.in_flight(), 0);
    assert!(store.contains(b"k"), "a backend failure evicts nothing");
    store.close();
}

struct TmpfsMount(PathBuf);
impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn mount(fstype: &str, opts: &str, dir: &Path) -> Option<TmpfsMount> {
    let ok = Command::new("mount").args(["-t", fstype, "-o", opts, fstype]).arg(dir).status().map(|s| s.success()).unwrap_or(false);
    if !ok {
        eprintln!("cannot mount {fstype} (not root?): skipping");
        return None;
    }
    Some(TmpfsMount(dir.to_path_buf()))
}

fn counter(store: &BlockStore, name: &str) -> u64 {
    store.stats().counters().iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no counter {name}")).1
}

fn temp_files(store: &BlockStore) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for ns in store.namespace_dirs() {
        for shard in std::fs::read_dir(ns).unwrap().flatten() {
            if shard.path().is_dir() {
                out.extend(
                    shard
                        .path()
                        .read_dir()
                        .unwrap()
                        .flatten()
                        .map(|e| e.path())
                        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(".tmp-")),
                );
            }
        }
    }
    out
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
        let mut expect = vec![0u8; 64 << 10];
        fill_vec(&mut expect, i as u8);
        assert_eq!(payload(&pool, a, 64 << 10), expect);
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

fn fill_vec(v: &mut [u8], seed: u8) {
    for (j, b) in v.iter_mut().enumerate() {
        *b = (j as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

fn chunk_file(store: &BlockStore, key: &[u8]) -> PathBuf {
    let h = pykvcache::key_hash(key);
    store.namespace_dirs()[0].join(format!("{:02x}", (h & 0xff) as u8)).join(format!("{h:032x}.kvc"))
}

fn inode(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().ino()
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
                let mut expect = vec![0u8; len];
                fill_vec(&mut expect, i as u8);
                assert_eq!(payload(&pool, a, len), expect);
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
        let mut expect = vec![0u8; 256 << 10];
        fill_vec(&mut expect, 8 + i as u8);
        assert_eq!(payload(&pool, s, 256 << 10), expect);
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

/// What a reader in another process holds while reading: a shared flock.
fn lock(path: &Path, how: i32) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: flock takes no pointer; `f` owns the descriptor and keeps it open.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), how | libc::LOCK_NB) }, 0);
    f
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

#[test]
fn filesystem_refusing_o_direct_falls_back_or_fails_by_policy() {
    let dir = tempfile::tempdir().unwrap();
    let Some(_m) = mount("ramfs", "mode=0700", dir.path()) else { return };
    let pool = Arc::new(StagingPool::create(1 << 20, 2, None).unwrap());
    let mut c = config(dir.path(), BackendChoice::IoUring);
    c.direct_io = DirectIoPolicy::Required;
    assert!(BlockStore::open(c, pool.clone()).is_err(), "required direct I/O must refuse ramfs");
    let store = open(config(dir.path(), BackendChoice::IoUring), &pool);
    assert!(!store.direct_io());
    assert!(store.stats().fallbacks().iter().any(|f| f.contains("O_DIRECT refused")));
    // ramfs has no fallocate either: chunk files are allocated by the writes.
    assert!(store.stats().fallbacks().iter().any(|f| f.contains("fallocate unsupported")), "{:?}", store.stats().fallbacks());
    round_trip(&store, &pool, b"buffered", 1 << 20, 8);
}

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
        let ns = &store.namespace_dirs()[0];
        paths = keys
            .iter()
            .map(|k| {
                let h = pykvcache::key_hash(k);
                ns.join(format!("{:02x}", (h & 0xff) as u8)).join(format!("{h:032x}.kvc"))
            })
            .collect();
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
            let mut expect = vec![0u8; 64 << 10];
            for (j, b) in expect.iter_mut().enumerate() {
                *b = (j as u8).wrapping_mul(31).wrapping_add(i as u8);
            }
            assert_eq!(payload(&pool, a, 64 << 10), expect);
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
fn concurrent_writers_of_one_key_are_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(512 << 10, 8, None).unwrap());
    let s1 = Arc::new(open(config(dir.path(), BackendChoice::IoUring), &pool));
    let s2 = Arc::new(open(config(dir.path(), BackendChoice::Threads), &pool));
    let mut threads = Vec::new();
    for t in 0..4 {
        let store = if t % 2 == 0 { s1.clone() } else { s2.clone() };
        let pool = pool.clone();
        threads.push(std::thread::spawn(move || {
            let a = pool.acquire(T).unwrap();
            for i in 0..20u8 {
                fill(&pool, a, 512 << 10, i);
                let o = wait(&store, store.put(&[i], a, 512 << 10, T).unwrap());
                assert_eq!(o.status, Status::Ok, "{}", o.message);
            }
            pool.release(a).unwrap();
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    let a = pool.acquire(T).unwrap();
    for i in 0..20u8 {
        let o = wait(&s2, s2.get(&[i], a, T).unwrap());
        assert_eq!(o.status, Status::Ok);
    }
    pool.release(a).unwrap();
    let races: u64 = [&s1, &s2].iter().map(|s| s.stats().counters().iter().find(|(n, _)| *n == "write_races").unwrap().1).sum();
    assert!(races > 0, "same keys written 4 times each: later writers must see the race");
}

#[test]
fn operations_on_unacquired_or_busy_slots_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let store = open(config(dir.path(), BackendChoice::IoUring), &pool);
    assert!(store.put(b"k", 0, 10, T).is_err(), "slot not acquired");
    let a = pool.acquire(T).unwrap();
    assert!(store.put(b"k", a, (64 << 10) + 1, T).is_err(), "longer than a slot");
    assert!(store.put(b"", a, 10, T).is_err(), "empty key");
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
    let mut expect = vec![0u8; 4096];
    fill_vec(&mut expect, 0);
    assert_eq!(payload(&pool, a, 4096), expect);
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
