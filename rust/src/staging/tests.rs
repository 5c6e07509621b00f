//! Unit tests of the staging region (moved out of staging.rs: one file, one job).

use super::*;
use std::sync::Arc;

#[test]
fn slots_are_aligned_and_budget_is_hard() {
    let pool = StagingPool::create(1 << 20, 3, None).unwrap();
    assert_eq!(pool.base_address() % MAP_ALIGN, 0);
    for s in 0..3 {
        assert_eq!(pool.payload_ptr(s) as usize % IO_ALIGN, 0);
    }
    let slots: Vec<_> = (0..3).map(|_| pool.acquire(Some(Duration::ZERO)).unwrap()).collect();
    let err = pool.acquire(Some(Duration::from_millis(50))).unwrap_err();
    assert!(matches!(err, EngineError::PoolExhausted { .. }));
    assert_eq!(pool.total_bytes(), 3 * pool.stride() + IO_ALIGN + TRAILER_BYTES);
    for s in slots {
        pool.release(s).unwrap();
    }
}

#[test]
fn sizes_that_would_wrap_or_overflow_are_refused() {
    // 2**64-1 wrapped the stride to 4096, 2**64-4097 to 0.
    let cases = [(usize::MAX, 2), (usize::MAX - 4096, 2), (isize::MAX as usize, 1), (1 << 62, 4), (0, 1), (4096, 0), (4096, MAX_SLOTS + 1)];
    for (slot_bytes, num_slots) in cases {
        let err = StagingPool::create(slot_bytes, num_slots, None).err();
        assert!(matches!(err, Some(EngineError::InvalidArgument(_))), "{slot_bytes} x {num_slots}: {err:?}");
    }
    let (stride, data_len) = layout(4097, 3).unwrap();
    assert_eq!((stride, data_len), (HEADER_BYTES + 8192, 3 * (HEADER_BYTES + 8192)));
}

#[test]
fn attach_refuses_a_trailer_whose_sizes_disagree() {
    let name = format!("pykvcache-test-forged-{}", std::process::id());
    let pool = StagingPool::create(8192, 2, Some(&name)).unwrap();
    // A slot size beyond the stride (stride x slots still matching the
    // file): views of it would reach past the mapping.
    // SAFETY: the trailer is the last TRAILER_BYTES of the pool's mapping, which `pool` keeps
    // mapped; nothing else refers to its first 32 bytes meanwhile.
    let trailer = unsafe { std::slice::from_raw_parts_mut(pool.region_ptr().add(pool.total_bytes() - TRAILER_BYTES), 32) };
    trailer[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(StagingPool::attach(&name), Err(EngineError::InvalidArgument(_))));
    trailer[8..16].copy_from_slice(&8192u64.to_le_bytes());
    assert!(StagingPool::attach(&name).is_ok());
}

#[test]
fn acquire_blocks_until_a_slot_is_released() {
    let pool = Arc::new(StagingPool::create(4096, 1, None).unwrap());
    let s = pool.acquire(None).unwrap();
    let p2 = pool.clone();
    let t = std::thread::spawn(move || p2.acquire(Some(Duration::from_secs(5))).unwrap());
    std::thread::sleep(Duration::from_millis(100));
    pool.release(s).unwrap();
    assert_eq!(t.join().unwrap(), s);
}

#[test]
fn exported_or_pinned_slots_cannot_be_recycled() {
    let pool = StagingPool::create(4096, 2, None).unwrap();
    let s = pool.acquire(None).unwrap();
    pool.export_begin(s).unwrap();
    assert!(pool.release(s).is_err());
    pool.export_end(s);
    pool.pin_io(s).unwrap();
    assert!(pool.pin_io(s).is_err(), "double I/O on one slot must be refused");
    assert!(pool.release(s).is_err());
    pool.unpin_io(s).unwrap();
    assert!(pool.unpin_io(s).is_err(), "an I/O ends once");
    pool.release(s).unwrap();
    assert!(pool.release(s).is_err(), "double release is an error");
}

#[test]
fn a_quarantined_slot_is_freed_only_when_its_io_ends() {
    let pool = StagingPool::create(4096, 1, None).unwrap();
    let s = pool.acquire(None).unwrap();
    pool.pin_io(s).unwrap();
    pool.quarantine(s);
    assert_eq!(pool.quarantined_slots(), 1);
    pool.release(s).unwrap(); // the owner gives it up: accepted, deferred
    assert_eq!(pool.deferred_releases(), 1);
    assert!(pool.acquire(Some(Duration::from_millis(20))).is_err(), "never handed out while the kernel may use it");
    assert!(pool.pin_io(s).is_err(), "no second I/O on it either");
    assert!(pool.export_begin(s).is_err() && !pool.is_acquired(s), "no longer the owner's: no view of it");
    assert!(pool.release(s).is_err(), "released once");
    pool.unpin_io(s).unwrap(); // the abandoned I/O really ended
    assert_eq!((pool.quarantined_slots(), pool.quarantine_releases(), pool.deferred_releases()), (0, 1, 0));
    assert_eq!(pool.acquire(Some(Duration::ZERO)).unwrap(), s);
    // A quarantine that comes after the I/O ended changes nothing.
    pool.quarantine(s);
    assert_eq!(pool.quarantined_slots(), 0);
}

#[test]
fn shared_memory_pool_is_visible_to_an_attached_mapping() {
    let name = format!("pykvcache-test-{}", std::process::id());
    let pool = StagingPool::create(8192, 2, Some(&name)).unwrap();
    let s = pool.acquire(None).unwrap();
    // SAFETY: `s` is leased by this test and no I/O uses it; its payload is mapped and writable.
    unsafe { *pool.payload_ptr(s) = 42 };
    let other = StagingPool::attach(&name).unwrap();
    assert_eq!(other.stride(), pool.stride());
    let off = other.payload_offset(s).unwrap();
    // SAFETY: `payload_offset` checked `s` against the mapping's slot count: the byte lies in
    // `other`'s mapping.
    assert_eq!(unsafe { *other.region_ptr().add(off) }, 42);
    assert!(other.acquire(None).is_err(), "attached pools do not own slot accounting");
    drop(other);
    pool.release(s).unwrap();
    drop(pool);
    assert!(StagingPool::attach(&name).is_err(), "owner removes the shm name");
    assert!(StagingPool::attach("../etc/passwd").is_err());
}

#[test]
fn memfd_pool_has_no_name_and_is_found_through_proc() {
    let name = format!("pykvcache-test-memfd-{}", std::process::id());
    let pool = StagingPool::create_backed(8192, 2, Backing::Memfd(&name)).unwrap();
    assert!(pool.is_memfd() && pool.is_owner());
    assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists(), "a memfd has no /dev/shm name");
    let s = pool.acquire(None).unwrap();
    // SAFETY: `s` is leased by this test and no I/O uses it; its payload is mapped and writable.
    unsafe { *pool.payload_ptr(s) = 42 };
    let other = StagingPool::attach_memfd(&name).unwrap();
    assert!(!other.is_owner() && !other.is_memfd());
    // SAFETY: `payload_offset` checked `s` against the mapping's slot count: the byte lies in
    // `other`'s mapping.
    assert_eq!(unsafe { *other.region_ptr().add(other.payload_offset(s).unwrap()) }, 42);
    assert!(StagingPool::attach(&name).is_err(), "not reachable by /dev/shm name");
    drop(other);
    pool.release(s).unwrap();
    drop(pool);
    let err = StagingPool::attach_memfd(&name).err().expect("the owner is gone");
    assert_eq!(err.errno(), Some(libc::ENOENT), "{err}");
}

#[test]
fn shared_memory_beyond_free_memory_is_refused_before_allocating() {
    let name = format!("pykvcache-test-huge-{}", std::process::id());
    // 1 TiB: more than this machine has; must fail without touching a page.
    let err = StagingPool::create_backed(1 << 40, 1, Backing::Memfd(&name)).err().expect("must fail");
    assert_eq!(err.errno(), Some(libc::ENOMEM), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("1048576.0 MiB") && msg.contains("available"), "{msg}");
}
