//! Sealed chunks (an encryption key configured, decision 0083), on real files
//! through both backends: round trips, ciphertext on disk, the caller's slot
//! never written by a put, chunks of other keys, tenants or of no key left in
//! place as misses, tampering found corrupt, the previous key, fresh nonces,
//! and the seal buffers' backpressure.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use pykvcache::{BackendChoice, BlockStore, DirectIoPolicy, EngineError, MissKind, StagingPool, Status, StoreConfig};

const BACKENDS: [BackendChoice; 2] = [BackendChoice::IoUring, BackendChoice::Threads];
// Header offsets of the sealed fields (rust/src/disk/format.rs).
const OFF_FLAGS: usize = 52;
const OFF_KEY_ID: usize = 1088;
const OFF_NONCE: usize = 1112;
const OFF_TAGS: usize = 1128;

fn key_file(dir: &Path, name: &str, byte: u8) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, [byte; 32]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn sealed_config(dir: &Path, backend: BackendChoice, key: &Path) -> StoreConfig {
    let mut c = config(dir, backend);
    c.encryption_key_file = Some(key.to_path_buf());
    c
}

fn put_for(store: &BlockStore, pool: &StagingPool, tenant: &[u8], key: &[u8], len: usize, seed: u8) {
    let a = pool.acquire(T).unwrap();
    fill(pool, a, len, seed);
    let o = wait(store, store.put_for(tenant, key, a, len, T).unwrap());
    assert_eq!(o.status, Status::Ok, "{}", o.message);
    pool.release(a).unwrap();
}

fn get_for(store: &BlockStore, pool: &StagingPool, tenant: &[u8], key: &[u8], len: usize) -> (pykvcache::Outcome, Vec<u8>) {
    let b = pool.acquire(T).unwrap();
    let o = wait(store, store.get_for(tenant, key, b, T).unwrap());
    let got = payload(pool, b, len);
    pool.release(b).unwrap();
    (o, got)
}

fn header(store: &BlockStore, key: &[u8]) -> Vec<u8> {
    std::fs::read(chunk_file(store, key)).unwrap()[..4096].to_vec()
}

#[test]
fn sealed_round_trips_at_many_sizes_on_both_backends_direct_or_not() {
    let dir = tempfile::tempdir().unwrap();
    let k = key_file(dir.path(), "key", 1);
    let pool = Arc::new(StagingPool::create(3 << 20, 4, None).unwrap());
    let mb = 1 << 20;
    for backend in BACKENDS {
        for direct in [DirectIoPolicy::Optional, DirectIoPolicy::Disabled] {
            let store_dir = tempfile::tempdir_in(dir.path()).unwrap();
            let mut c = sealed_config(store_dir.path(), backend, &k);
            c.direct_io = direct;
            let store = open(c, &pool);
            for (i, len) in [0, 1, 4095, 4096, 5000, mb - 1, mb, mb + 1, 2 * mb + 4096, 3 << 20].into_iter().enumerate() {
                let key = format!("k{len}");
                put_for(&store, &pool, b"", key.as_bytes(), len, i as u8);
                let (o, got) = get_for(&store, &pool, b"", key.as_bytes(), len);
                assert_eq!((o.status, o.length), (Status::Ok, len as u64), "{backend:?} {direct:?} {len}: {}", o.message);
                assert_eq!(got, pattern(len, i as u8), "{backend:?} {direct:?} {len}");
                let h = header(&store, key.as_bytes());
                assert_eq!(u32::from_le_bytes(h[OFF_FLAGS..OFF_FLAGS + 4].try_into().unwrap()), 2, "FLAG_SEALED");
            }
            assert_eq!(counter(&store, "sealed_puts"), 10);
            assert_eq!(counter(&store, "opened_gets"), 10);
            store.close();
        }
    }
}

#[test]
fn no_plaintext_on_disk_and_the_callers_slot_is_never_written() {
    let dir = tempfile::tempdir().unwrap();
    let k = key_file(dir.path(), "key", 2);
    let pool = Arc::new(StagingPool::create(1 << 20, 2, None).unwrap());
    for backend in BACKENDS {
        let store_dir = tempfile::tempdir_in(dir.path()).unwrap();
        let store = open(sealed_config(store_dir.path(), backend, &k), &pool);
        let a = pool.acquire(T).unwrap();
        let marker = b"PLAINTEXT-MARKER-0123456789abcdef";
        // The whole slot, its header area included, is the caller's bytes.
        // SAFETY: slot `a` is leased here and in no operation; `stride` bytes from its start are its own.
        let slot = unsafe { std::slice::from_raw_parts_mut(pool.slot_ptr(a), pool.stride()) };
        for (i, b) in slot.iter_mut().enumerate() {
            *b = marker[i % marker.len()];
        }
        let before = slot.to_vec();
        let len = (1 << 20) - 100;
        let o = wait(&store, store.put(b"secret", a, len, T).unwrap());
        assert_eq!(o.status, Status::Ok, "{}", o.message);
        // SAFETY: as above; the put completed.
        let after = unsafe { std::slice::from_raw_parts(pool.slot_ptr(a), pool.stride()) };
        assert!(before == after, "{backend:?}: a sealed put wrote the caller's slot");
        let file = std::fs::read(chunk_file(&store, b"secret")).unwrap();
        assert!(!file.windows(16).any(|w| marker.windows(16).any(|m| m == w)), "{backend:?}: plaintext in the chunk file");
        pool.release(a).unwrap();
        store.close();
    }
}

#[test]
fn chunks_of_no_key_another_key_or_tenant_are_misses_never_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let (ka, kb) = (key_file(dir.path(), "a", 3), key_file(dir.path(), "b", 4));
    let pool = Arc::new(StagingPool::create(1 << 20, 2, None).unwrap());
    let store_dir = tempfile::tempdir_in(dir.path()).unwrap();
    let plain = open(config(store_dir.path(), BackendChoice::IoUring), &pool);
    put_for(&plain, &pool, b"", b"planted", 5000, 1);
    plain.close();
    let sealed = open(sealed_config(store_dir.path(), BackendChoice::IoUring, &ka), &pool);
    put_for(&sealed, &pool, b"t1", b"mine", 5000, 2);
    let (o, _) = get_for(&sealed, &pool, b"", b"planted", 5000);
    assert_eq!((o.status, o.miss_kind), (Status::Miss, Some(MissKind::Kept)), "{}", o.message);
    assert!(o.message.contains("plaintext"), "{}", o.message);
    let (o, _) = get_for(&sealed, &pool, b"t2", b"mine", 5000);
    assert_eq!((o.status, o.miss_kind), (Status::Miss, Some(MissKind::Kept)), "{}", o.message);
    assert!(o.message.contains("another tenant"), "{}", o.message);
    let (o, got) = get_for(&sealed, &pool, b"t1", b"mine", 5000);
    assert_eq!((o.status, got), (Status::Ok, pattern(5000, 2)));
    assert_eq!(counter(&sealed, "not_ours_misses"), 2);
    let files = [chunk_file(&sealed, b"planted"), chunk_file(&sealed, b"mine")];
    sealed.close();
    let other = open(sealed_config(store_dir.path(), BackendChoice::Threads, &kb), &pool);
    let (o, _) = get_for(&other, &pool, b"t1", b"mine", 5000);
    assert_eq!((o.status, o.miss_kind), (Status::Miss, Some(MissKind::Kept)), "{}", o.message);
    assert!(o.message.contains("another key"), "{}", o.message);
    other.close();
    let plain = open(config(store_dir.path(), BackendChoice::IoUring), &pool);
    let (o, _) = get_for(&plain, &pool, b"", b"mine", 5000);
    assert_eq!((o.status, o.miss_kind), (Status::Miss, Some(MissKind::Kept)), "{}", o.message);
    assert!(files.iter().all(|f| f.exists()), "a reader deleted a chunk that was not its own");
    plain.close();
}

#[test]
fn a_flipped_bit_in_the_sealed_fields_the_payload_or_a_tag_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let k = key_file(dir.path(), "key", 5);
    let pool = Arc::new(StagingPool::create(3 << 20, 2, None).unwrap());
    let len = (2 << 20) + 123;
    // (offset in the file, whether the header CRC is recomputed: a forger's edit)
    let cases = [(OFF_NONCE + 3, true), (OFF_TAGS + 17, true), (OFF_TAGS + 5, false), (4096 + 10, false), (4096 + (1 << 20) + 7, false)];
    for backend in BACKENDS {
        for (i, (at, recrc)) in cases.into_iter().enumerate() {
            let store_dir = tempfile::tempdir_in(dir.path()).unwrap();
            let store = open(sealed_config(store_dir.path(), backend, &k), &pool);
            let key = format!("k{i}");
            put_for(&store, &pool, b"", key.as_bytes(), len, 7);
            let path = chunk_file(&store, key.as_bytes());
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[at] ^= 0x04;
            if recrc {
                bytes[48..52].fill(0);
                let crc = crc32c(&bytes[..4096]);
                bytes[48..52].copy_from_slice(&crc.to_le_bytes());
            }
            std::fs::write(&path, &bytes).unwrap();
            let (o, _) = get_for(&store, &pool, b"", key.as_bytes(), len);
            assert_eq!(o.status, Status::Corrupt, "{backend:?} byte {at}: {}", o.message);
            assert!(!path.exists(), "a corrupt chunk is removed");
            if recrc || at >= 4096 {
                assert_eq!(counter(&store, "auth_failures"), 1, "{backend:?} byte {at}: {}", o.message);
            }
            store.close();
        }
    }
}

/// CRC-32C (Castagnoli), bitwise: the header CRC a forger recomputes.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

#[test]
fn the_previous_key_reads_and_new_puts_use_the_current_key() {
    let dir = tempfile::tempdir().unwrap();
    let (ka, kb) = (key_file(dir.path(), "a", 6), key_file(dir.path(), "b", 7));
    let pool = Arc::new(StagingPool::create(1 << 20, 2, None).unwrap());
    let store_dir = tempfile::tempdir_in(dir.path()).unwrap();
    let store = open(sealed_config(store_dir.path(), BackendChoice::IoUring, &ka), &pool);
    put_for(&store, &pool, b"t", b"old", 9000, 1);
    let old_id = header(&store, b"old")[OFF_KEY_ID..OFF_KEY_ID + 8].to_vec();
    store.close();
    let mut c = sealed_config(store_dir.path(), BackendChoice::IoUring, &kb);
    c.encryption_previous_key_file = Some(ka.clone());
    let store = open(c, &pool);
    let (o, got) = get_for(&store, &pool, b"t", b"old", 9000);
    assert_eq!((o.status, got), (Status::Ok, pattern(9000, 1)), "{}", o.message);
    put_for(&store, &pool, b"t", b"new", 9000, 2);
    let new_id = header(&store, b"new")[OFF_KEY_ID..OFF_KEY_ID + 8].to_vec();
    assert_ne!(old_id, new_id, "new chunks are sealed with the current key");
    store.close();
    let store = open(sealed_config(store_dir.path(), BackendChoice::IoUring, &kb), &pool);
    let (o, _) = get_for(&store, &pool, b"t", b"old", 9000);
    assert_eq!(o.miss_kind, Some(MissKind::Kept), "without the previous key: {}", o.message);
    let (o, _) = get_for(&store, &pool, b"t", b"new", 9000);
    assert_eq!(o.status, Status::Ok, "{}", o.message);
    store.close();
}

#[test]
fn recycled_files_get_fresh_nonces() {
    let dir = tempfile::tempdir().unwrap();
    let k = key_file(dir.path(), "key", 8);
    let pool = Arc::new(StagingPool::create(64 << 10, 2, None).unwrap());
    let store_dir = tempfile::tempdir_in(dir.path()).unwrap();
    let mut c = sealed_config(store_dir.path(), BackendChoice::IoUring, &k);
    c.capacity_bytes = 4 * pykvcache::chunk_file_bytes(64 << 10) as u64;
    let store = open(c, &pool);
    let mut seen = HashSet::new();
    for i in 0..40u32 {
        let key = format!("k{i}");
        put_for(&store, &pool, b"", key.as_bytes(), 64 << 10, i as u8);
        let h = header(&store, key.as_bytes());
        assert!(seen.insert((h[OFF_KEY_ID..OFF_KEY_ID + 8].to_vec(), h[OFF_NONCE..OFF_NONCE + 12].to_vec())), "nonce repeated");
    }
    assert!(counter(&store, "recycled_files") > 30, "the files were recycled");
    store.close();
}

#[test]
fn seal_buffers_bound_puts_in_flight_with_the_submit_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let k = key_file(dir.path(), "key", 9);
    let pool = Arc::new(StagingPool::create(4 << 20, 4, None).unwrap());
    let store_dir = tempfile::tempdir_in(dir.path()).unwrap();
    let mut c = sealed_config(store_dir.path(), BackendChoice::IoUring, &k);
    c.seal_buffers = 1;
    c.chunk_workers = 1;
    // Every transfer moves 4 KiB at a time: the first put holds its buffer a while.
    c.faults = Some(Arc::new(pykvcache::FaultPlan { max_transfer: Some(4096), ..Default::default() }));
    let store = Arc::new(open(c, &pool));
    let (a, b) = (pool.acquire(T).unwrap(), pool.acquire(T).unwrap());
    fill(&pool, a, 4 << 20, 1);
    fill(&pool, b, 4 << 20, 2);
    let first = store.put(b"first", a, 4 << 20, T).unwrap();
    match store.put(b"second", b, 4 << 20, Some(Duration::ZERO)) {
        Err(EngineError::SealBuffersBusy { buffers: 1, .. }) => {}
        other => panic!("expected the seal buffers' backpressure, got {:?}", other.map(|_| ())),
    }
    // Waiting for the buffer ends when the first put finishes: never a deadlock.
    let second = store.put(b"second", b, 4 << 20, T).unwrap();
    assert_eq!(wait(&store, first).status, Status::Ok);
    assert_eq!(wait(&store, second).status, Status::Ok);
    assert_eq!(store.snapshot().sealing.unwrap().seal_buffers_free, 1);
    pool.release(a).unwrap();
    pool.release(b).unwrap();
    store.close();
}

#[test]
fn region_puts_seal_without_writing_the_region_and_gets_open_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let k = key_file(dir.path(), "key", 10);
    let pool = Arc::new(StagingPool::create(1 << 20, 1, None).unwrap());
    let row = 1 << 20;
    let layout = std::alloc::Layout::from_size_align(3 * row, 4096).unwrap();
    // SAFETY: a non-zero size; checked for null below.
    let base = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!base.is_null());
    // SAFETY: the allocation is `3 * row` bytes, used by this test alone while no operation runs.
    let mem = unsafe { std::slice::from_raw_parts_mut(base, 3 * row) };
    fill_vec(&mut mem[..row], 3);
    let before = mem[..row].to_vec();
    for backend in BACKENDS {
        let store_dir = tempfile::tempdir_in(dir.path()).unwrap();
        let store = open(sealed_config(store_dir.path(), backend, &k), &pool);
        // SAFETY: the memory stays allocated and unmoved until after `unregister_region` below.
        let id = unsafe { store.register_region(base, 3 * row) }.unwrap();
        let o = wait(&store, store.put_region_for(b"t", b"r", id, 0, row, T).unwrap());
        assert_eq!(o.status, Status::Ok, "{}", o.message);
        // SAFETY: as above; the put completed.
        assert!(unsafe { std::slice::from_raw_parts(base, row) } == &before[..], "{backend:?}: a sealed put wrote the region");
        let o = wait(&store, store.get_region_for(b"t", b"r", id, row, row, T).unwrap());
        assert_eq!(o.status, Status::Ok, "{}", o.message);
        // SAFETY: as above; the get completed.
        assert!(unsafe { std::slice::from_raw_parts(base.add(row), row) } == &before[..], "{backend:?}");
        let too_long = store.put_region_for(b"t", b"big", id, 0, 2 * row, T);
        assert!(matches!(too_long, Err(EngineError::InvalidArgument(_))), "longer than a seal buffer");
        store.unregister_region(id, T).unwrap();
        store.close();
    }
    // SAFETY: allocated above with this layout; the stores let go of it.
    unsafe { std::alloc::dealloc(base, layout) };
}
