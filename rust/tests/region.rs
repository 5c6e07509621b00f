//! External-region I/O on real files with the real backends: chunk payloads
//! written from and read into caller memory (no staging slot), the on-disk
//! format shared with the slot path, every bounds and lifetime error, a
//! corrupt chunk failing only its key, and a restart.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{chunk_file, wait, T};
use pykvcache::{BackendChoice, BlockStore, DirectIoPolicy, MissKind, OpId, RegionId, StagingPool, Status, StoreConfig, VerifyPolicy};

const ROW: usize = 160 << 10;
const ROWS: usize = 4;

/// Page-aligned memory the test owns, as vLLM's CPU tier owns its region.
struct Region {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Region {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: `len` is positive (every test asks for whole rows); a null result fails the
        // tests' first use.
        Region { ptr: unsafe { std::alloc::alloc_zeroed(layout) }, layout }
    }
    fn row(&self, i: usize) -> &[u8] {
        // SAFETY: rows lie within the allocation (the tests index `i < ROWS` of a `ROW * ROWS`
        // region); `&self` excludes writes through `row_mut`, and the tests read a row only while
        // no operation on it is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr.add(i * ROW), ROW) }
    }
    fn row_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: as in `row`, with `&mut self` excluding every other access from the test; no
        // operation on the row is in flight.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * ROW), ROW) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout, freed once; each test drops its region
        // after the store let go of it.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

fn config(dir: &Path, backend: BackendChoice) -> StoreConfig {
    let mut c = StoreConfig::new(vec![dir.to_path_buf()], "test-namespace", 1 << 30);
    c.backend = backend;
    // Multi-segment payloads, and 4 KiB read segments (numbered from 1 after the header block).
    c.segment_bytes = 4 << 10;
    c.write_segment_bytes = 64 << 10;
    c
}

fn open(c: StoreConfig) -> (BlockStore, Arc<StagingPool>) {
    let pool = Arc::new(StagingPool::create(ROW, 2, None).unwrap());
    (BlockStore::open(c, pool.clone()).expect("open store").0, pool)
}

fn fill(row: &mut [u8], seed: u8) {
    for (i, b) in row.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8;
    }
}

fn register(store: &BlockStore, r: &Region) -> RegionId {
    // SAFETY: `r` is `ROW * ROWS` bytes that every test keeps alive, unmoved, until after the store
    // is dropped or the region unregistered.
    unsafe { store.register_region(r.ptr, ROW * ROWS) }.unwrap()
}

#[test]
fn region_round_trips_on_every_backend_and_shares_the_slot_format() {
    let cases = [
        (BackendChoice::IoUring, true, VerifyPolicy::Full, DirectIoPolicy::Optional),
        (BackendChoice::IoUring, false, VerifyPolicy::Header, DirectIoPolicy::Optional),
        (BackendChoice::Threads, false, VerifyPolicy::Full, DirectIoPolicy::Optional),
        // The buffered path (what a filesystem refusing O_DIRECT gets).
        (BackendChoice::IoUring, true, VerifyPolicy::Full, DirectIoPolicy::Disabled),
    ];
    for (backend, fixed, verify, direct) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path(), backend);
        (c.register_buffers, c.verify, c.direct_io) = (fixed, verify, direct);
        let (store, pool) = open(c);
        assert_eq!(store.direct_io(), direct != DirectIoPolicy::Disabled);
        let mut region = Region::new(ROW * ROWS);
        let id = register(&store, &region);
        fill(region.row_mut(0), 1);
        fill(region.row_mut(1), 2);
        for (key, row) in [(&b"a"[..], 0), (b"b", 1)] {
            let o = wait(&store, store.put_region(key, id, row * ROW, ROW, T).unwrap());
            assert_eq!(o.status, Status::Ok, "{backend:?} {verify:?}: {}", o.message);
        }
        for (key, row) in [(&b"a"[..], 3), (b"b", 2)] {
            let o = wait(&store, store.get_region(key, id, row * ROW, ROW, T).unwrap());
            assert_eq!((o.status, o.length), (Status::Ok, ROW as u64), "{}", o.message);
        }
        assert!(region.row(3) == region.row(0) && region.row(2) == region.row(1), "{backend:?} {verify:?}");
        // The slot path reads what a region wrote, and the other way round.
        let slot = pool.acquire(T).unwrap();
        let o = wait(&store, store.get(b"a", slot, T).unwrap());
        assert_eq!(o.status, Status::Ok, "{}", o.message);
        // SAFETY: `slot` is leased here, ROW is its payload size, and its get has completed.
        assert!(unsafe { std::slice::from_raw_parts(pool.payload_ptr(slot), ROW) } == region.row(0));
        // SAFETY: `slot` is leased here, ROW is its payload size, and no operation uses it.
        fill(unsafe { std::slice::from_raw_parts_mut(pool.payload_ptr(slot), ROW) }, 9);
        assert_eq!(wait(&store, store.put(b"s", slot, ROW, T).unwrap()).status, Status::Ok);
        assert_eq!(wait(&store, store.get_region(b"s", id, 0, ROW, T).unwrap()).status, Status::Ok);
        // SAFETY: `slot` is leased here, ROW is its payload size, and the operations on it have
        // completed.
        assert!(unsafe { std::slice::from_raw_parts(pool.payload_ptr(slot), ROW) } == region.row(0));
        pool.release(slot).unwrap();
        store.unregister_region(id, T).unwrap();
        assert_eq!(store.region_count(), 0);
        store.close();
    }
}

#[test]
fn bounds_and_lifetime_errors_are_errors_never_faults() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _pool) = open(config(dir.path(), BackendChoice::IoUring));
    let mut region = Region::new(ROW * ROWS);
    let id = register(&store, &region);
    let refused = |r: pykvcache::Result<OpId>| r.expect_err("must be refused").to_string();
    // Outside the region, overflowing, empty, not whole blocks, misaligned.
    assert!(refused(store.put_region(b"k", id, ROW * ROWS, ROW, T)).contains("outside the region"));
    assert!(refused(store.get_region(b"k", id, ROW * 3 + 4096, ROW, T)).contains("outside the region"));
    assert!(refused(store.get_region(b"k", id, usize::MAX, ROW, T)).contains("outside the region"));
    assert!(refused(store.put_region(b"k", id, 0, 0, T)).contains("multiple of 4096"));
    assert!(refused(store.put_region(b"k", id, 0, 1000, T)).contains("multiple of 4096"));
    assert!(refused(store.get_region(b"k", id, 512, 4096, T)).contains("aligned"));
    assert!(refused(store.get_region(b"", id, 0, ROW, T)).contains("key"));
    // A chunk larger than the row it should land in: a miss, kept on disk.
    assert_eq!(wait(&store, store.put_region(b"big", id, 0, 2 * ROW, T).unwrap()).status, Status::Ok);
    let o = wait(&store, store.get_region(b"big", id, 0, ROW, T).unwrap());
    assert_eq!((o.status, o.miss_kind), (Status::Miss, Some(MissKind::Kept)), "{}", o.message);
    assert!(chunk_file(&store, b"big").exists());
    let o = wait(&store, store.get_region(b"absent", id, 0, ROW, T).unwrap());
    assert_eq!((o.status, o.miss_kind), (Status::Miss, Some(MissKind::Absent)));
    // Unregistered: refused, also under an id whose index a new region took.
    store.unregister_region(id, T).unwrap();
    assert!(refused(store.put_region(b"k", id, 0, ROW, T)).contains("not registered"));
    assert!(store.unregister_region(id, T).is_err());
    let again = register(&store, &region);
    assert_eq!(again.index, id.index);
    assert!(refused(store.get_region(b"big", id, 0, 2 * ROW, T)).contains("not registered"));
    // SAFETY: refused (a null base): the store never touches it.
    assert!(unsafe { store.register_region(std::ptr::null_mut(), 4096) }.is_err());
    // Closed: no operation; the region is the caller's (closing never touches it).
    store.close();
    assert!(refused(store.get_region(b"big", again, 0, 2 * ROW, T)).contains("closed"));
    // SAFETY: refused (the store is closed): the store never touches it.
    assert!(unsafe { store.register_region(region.ptr, ROW) }.is_err());
    store.unregister_region(again, T).unwrap();
    region.row_mut(0).fill(7);
}

#[test]
fn a_flipped_payload_byte_fails_only_its_key_and_chunks_survive_a_restart() {
    use std::io::{Read, Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().unwrap();
    let mut region = Region::new(ROW * ROWS);
    {
        let (store, _pool) = open(config(dir.path(), BackendChoice::IoUring));
        let id = register(&store, &region);
        for (key, row) in [(&b"bad"[..], 0), (b"good", 1)] {
            fill(region.row_mut(row), row as u8 + 3);
            assert_eq!(wait(&store, store.put_region(key, id, row * ROW, ROW, T).unwrap()).status, Status::Ok);
        }
        store.unregister_region(id, T).unwrap();
        store.close();
    }
    let expected = region.row(1).to_vec();
    let (store, _pool) = open(config(dir.path(), BackendChoice::IoUring));
    assert_eq!(store.len(), 2, "the index is rebuilt from the files");
    let path = chunk_file(&store, b"bad");
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let at = pykvcache::HEADER_BYTES as u64 + 70_000;
    let mut byte = [0u8];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut byte).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[byte[0] ^ 0x40]).unwrap();
    drop(f);
    let id = register(&store, &region);
    let o = wait(&store, store.get_region(b"bad", id, 2 * ROW, ROW, T).unwrap());
    assert_eq!(o.status, Status::Corrupt, "{}", o.message);
    assert!(!path.exists() && !store.contains(b"bad"), "a corrupt chunk is removed");
    let o = wait(&store, store.get_region(b"good", id, 3 * ROW, ROW, T).unwrap());
    assert_eq!(o.status, Status::Ok, "{}", o.message);
    assert!(region.row(3) == &expected[..]);
    store.unregister_region(id, T).unwrap();
}
