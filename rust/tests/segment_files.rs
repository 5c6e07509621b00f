//! Segment files (`segment_files`, decision 0086) on real files with real
//! io_uring: chunks written into slots and published by their segment's
//! index are read by the writer, by another store on the same directory
//! (found at its open, or when a get misses), after a restart; a slot no
//! index lists is never found; a torn index leaves the previous one in force;
//! an evicted slot is punched and is a miss, not a corrupt chunk, elsewhere;
//! another namespace's slots count against the capacity and are evicted
//! first when stalest; a punched slot is not counted after a restart; an
//! emptied, sealed segment is unlinked.

mod common;

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{fill, payload, wait, T};
use pykvcache::{chunk_file_bytes, BackendChoice, BlockStore, MissKind, SegmentFiles, StagingPool, Status, StoreConfig};

const PAYLOAD: usize = 60 << 10;
const INDEX_BYTES: u64 = 4096;

fn config(dir: &Path, capacity_chunks: u64) -> StoreConfig {
    let mut c = StoreConfig::new(vec![dir.to_path_buf()], "segments", capacity_chunks * chunk_file_bytes(PAYLOAD) as u64);
    c.backend = BackendChoice::IoUring;
    c.segment_files = SegmentFiles::On;
    c.min_free = pykvcache::FreeSpaceReserve::AtLeast { bytes: 0, fraction: 0.0 };
    c
}

fn pool() -> Arc<StagingPool> {
    Arc::new(StagingPool::create(PAYLOAD, 16, None).unwrap())
}

fn open(dir: &Path, capacity_chunks: u64, pool: &Arc<StagingPool>) -> BlockStore {
    BlockStore::open(config(dir, capacity_chunks), pool.clone()).expect("open").0
}

/// A store of namespace `ns`; `writes`: with segment files, else one file per chunk.
fn open_ns(dir: &Path, ns: &str, capacity_chunks: u64, writes: bool, pool: &Arc<StagingPool>) -> BlockStore {
    let mut c = config(dir, capacity_chunks);
    c.namespace = ns.into();
    c.segment_files = if writes { SegmentFiles::On } else { SegmentFiles::Off };
    BlockStore::open(c, pool.clone()).expect("open").0
}

/// Every segment file under `root`, any namespace.
fn all_segments(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for ns in std::fs::read_dir(root).unwrap().flatten() {
        if let Ok(log) = std::fs::read_dir(ns.path().join("log")) {
            out.extend(log.flatten().map(|e| e.path()));
        }
    }
    out.sort();
    out
}

fn seed(i: usize) -> u8 {
    (i * 7 + 1) as u8
}

/// Puts chunks `keys` with 8 in flight; every put Ok.
fn put_all(store: &BlockStore, pool: &StagingPool, keys: &[usize]) {
    for batch in keys.chunks(8) {
        let mut ops = Vec::new();
        for &i in batch {
            let slot = pool.acquire(T).unwrap();
            fill(pool, slot, PAYLOAD, seed(i));
            ops.push((slot, store.put(format!("k{i}").as_bytes(), slot, PAYLOAD, T).unwrap()));
        }
        for (slot, id) in ops {
            let o = wait(store, id);
            assert_eq!(o.status, Status::Ok, "{}", o.message);
            pool.release(slot).unwrap();
        }
    }
}

/// Gets chunk `i`: its outcome, and whether the bytes are chunk `i`'s.
fn get(store: &BlockStore, pool: &StagingPool, i: usize) -> pykvcache::Outcome {
    let slot = pool.acquire(T).unwrap();
    let o = wait(store, store.get(format!("k{i}").as_bytes(), slot, T).unwrap());
    if o.status == Status::Ok {
        assert_eq!(payload(pool, slot, PAYLOAD), common::pattern(PAYLOAD, seed(i)), "chunk {i} served with another's bytes");
    }
    pool.release(slot).unwrap();
    o
}

fn segments(store: &BlockStore) -> Vec<PathBuf> {
    let dir = store.namespace_dirs()[0].join("log");
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    out.sort();
    out
}

fn chunk_files(store: &BlockStore) -> usize {
    let ns = &store.namespace_dirs()[0];
    std::fs::read_dir(ns)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir() && e.file_name() != "log")
        .map(|shard| std::fs::read_dir(shard.path()).unwrap().count())
        .sum()
}

#[test]
fn chunks_in_segments_are_read_by_their_writer_by_another_store_and_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let p = pool();
    let a = open(dir.path(), 1000, &p);
    let b = open(dir.path(), 1000, &p);
    let keys: Vec<usize> = (0..40).collect();
    put_all(&a, &p, &keys);
    assert_eq!(chunk_files(&a), 0, "a store with segment files wrote chunk files");
    let segs = segments(&a);
    assert_eq!(segs.len(), 1, "40 chunks of 64 KiB fit one segment: {segs:?}");
    for &i in &keys {
        assert_eq!(get(&a, &p, i).status, Status::Ok, "the writer's chunk {i}");
        // Opened before the puts: found when its get missed (one look at the index).
        assert_eq!(get(&b, &p, i).status, Status::Ok, "another store's chunk {i}");
    }
    drop(a);
    drop(b);
    let c = open(dir.path(), 1000, &p);
    assert!(c.contains(b"k39"), "a store opened later indexes the segment's chunks at open");
    for &i in &keys {
        assert_eq!(get(&c, &p, i).status, Status::Ok, "chunk {i} after a restart");
    }
    assert_eq!(get(&c, &p, 1000).status, Status::Miss);
}

#[test]
fn a_slot_no_index_lists_is_never_found_and_a_torn_index_leaves_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let p = pool();
    // Two publications at queue depth 1: k0 alone (copy B), then k0 and k1 (copy A). The
    // writer stays open (its close would seal the segment with a third publication).
    let a = open(dir.path(), 1000, &p);
    put_all(&a, &p, &[0]);
    put_all(&a, &p, &[1]);
    let seg = segments(&a).pop().unwrap();
    let slot_bytes = chunk_file_bytes(PAYLOAD) as u64;
    // A sound chunk image of k2, written into slot 2 as a crashed writer
    // would have left it: data on disk, no publication.
    let w = open(other.path(), 1000, &p);
    put_all(&w, &p, &[2]);
    let image = std::fs::read(segments(&w).pop().unwrap()).unwrap()[2 * INDEX_BYTES as usize..][..slot_bytes as usize].to_vec();
    drop(w);
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.write_all_at(&image, 2 * INDEX_BYTES + 2 * slot_bytes).unwrap();
    let b = open(dir.path(), 1000, &p);
    assert_eq!(get(&b, &p, 0).status, Status::Ok);
    assert_eq!(get(&b, &p, 1).status, Status::Ok);
    let o = get(&b, &p, 2);
    assert_eq!((o.status, o.miss_kind), (Status::Miss, Some(MissKind::Absent)), "an unpublished slot was served: {}", o.message);
    drop(b);
    // The newest publication's copy (A, listing k0 and k1) torn: copy B (k0 only) is in force.
    f.write_all_at(&[0xff; 64], 512).unwrap();
    let c = open(dir.path(), 1000, &p);
    assert_eq!(get(&c, &p, 0).status, Status::Ok);
    assert_eq!(get(&c, &p, 1).status, Status::Miss, "a torn index was trusted");
    drop(a);
}

#[test]
fn an_evicted_slot_is_punched_and_another_store_gets_a_miss_not_a_corrupt_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let p = pool();
    let a = open(dir.path(), 16, &p);
    put_all(&a, &p, &(0..8).collect::<Vec<_>>());
    let b = open(dir.path(), 1000, &p);
    assert!(b.contains(b"k0"));
    let seg = segments(&a).pop().unwrap();
    let allocated = std::fs::metadata(&seg).unwrap().blocks() * 512;
    // 16 more chunks into a capacity of 16: the 8 first are evicted (punched).
    put_all(&a, &p, &(8..24).collect::<Vec<_>>());
    assert!(!a.contains(b"k0"));
    // 24 slots written, 8 of them evicted: the 16 live ones, the index copies and at most one
    // slot allocated ahead (a 32nd of the capacity) hold blocks; the evicted ones are holes.
    let after = std::fs::metadata(&seg).unwrap().blocks() * 512;
    let slot = chunk_file_bytes(PAYLOAD) as u64;
    assert!(
        after <= 17 * slot + 2 * INDEX_BYTES,
        "punched slots hold no blocks: {after} bytes allocated ({allocated} before the evictions)"
    );
    let o = get(&b, &p, 0);
    assert_eq!((o.status, o.miss_kind), (Status::Miss, Some(MissKind::Absent)), "{}", o.message);
    assert_eq!(common::counter(&b, "corrupt_chunks"), 0);
    for i in 8..24 {
        assert_eq!(get(&b, &p, i).status, Status::Ok, "chunk {i}");
    }
}

#[test]
fn another_namespaces_slots_count_against_the_capacity_and_punched_ones_are_not_counted_again() {
    let dir = tempfile::tempdir().unwrap();
    let p = pool();
    let slot = chunk_file_bytes(PAYLOAD) as u64;
    // Namespace "a" writes 12 chunks into a segment, and closes (sealing it).
    let a = open_ns(dir.path(), "a", 1000, true, &p);
    put_all(&a, &p, &(0..12).collect::<Vec<_>>());
    drop(a);
    // A store of namespace "b" with one file per chunk and room for 16 finds them at open...
    let b = open_ns(dir.path(), "b", 16, false, &p);
    assert_eq!(b.other_namespace_usage(), (12, 12 * slot), "the other namespace's chunks in segments");
    // ...and its 12 chunks evict the 8 stalest of them, "a"'s (their slots punched).
    put_all(&b, &p, &(100..112).collect::<Vec<_>>());
    assert_eq!(common::counter(&b, "other_namespace_evictions"), 8);
    // What "a" allocated ahead and did not use went back at its close.
    let held: u64 = all_segments(dir.path()).iter().map(|s| std::fs::metadata(s).unwrap().blocks() * 512).sum();
    assert!(held <= 4 * slot + 2 * INDEX_BYTES, "8 of 12 slots punched: {held} bytes allocated");
    drop(b);
    // Reopened, "a" counts the 4 chunks left, not the 12 its index lists.
    let a = open_ns(dir.path(), "a", 1000, true, &p);
    assert_eq!(a.len(), 4, "slots punched since their publication were counted");
    for i in 0..12 {
        assert_eq!(get(&a, &p, i).status, if i < 8 { Status::Miss } else { Status::Ok }, "chunk {i}");
    }
    assert_eq!(common::counter(&a, "corrupt_chunks"), 0);
}

#[test]
fn a_sealed_segment_whose_slots_are_all_punched_is_unlinked_by_a_walk() {
    let dir = tempfile::tempdir().unwrap();
    let p = pool();
    let a = open_ns(dir.path(), "a", 1000, true, &p);
    put_all(&a, &p, &(0..8).collect::<Vec<_>>());
    // Until its refresh thread's next transaction (within a second), the capacity ledger
    // counts a live writer's last chunks as in flight: a store that evicts them meanwhile
    // cannot tell, and refuses its put (the shared capacity's own rule, decision 0053).
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let b = open_ns(dir.path(), "b", 8, true, &p);
    // "a" still writes its segment: however empty, it stays.
    put_all(&b, &p, &(100..108).collect::<Vec<_>>());
    assert_eq!(common::counter(&b, "other_namespace_evictions"), 8);
    b.refresh().unwrap();
    assert_eq!(all_segments(dir.path()).len(), 2, "a segment its live writer may add to was unlinked");
    // Closed, "a" sealed it: the next walk finds it emptied and unlinks it.
    drop(a);
    b.refresh().unwrap();
    assert_eq!(common::counter(&b, "segments_unlinked"), 1);
    assert_eq!(all_segments(dir.path()), segments(&b), "only b's segment is left");
    for i in 100..108 {
        assert_eq!(get(&b, &p, i).status, Status::Ok, "chunk {i}");
    }
}
