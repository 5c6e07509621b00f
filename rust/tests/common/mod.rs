//! What the store tests share: a store on a temporary directory with small
//! segments, slots filled with a seeded pattern and read back, operations
//! waited for, counters, the chunk files on disk, and filesystems mounted
//! for a test (tmpfs, ramfs).

// Each test file is its own crate and uses a part of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use pykvcache::{BackendChoice, BlockStore, OpId, StagingPool, Status, StoreConfig};

pub const T: Option<Duration> = Some(Duration::from_secs(30));

pub fn config(dir: &Path, backend: BackendChoice) -> StoreConfig {
    let mut c = StoreConfig::new(vec![dir.to_path_buf()], "test-namespace", 1 << 30);
    c.backend = backend;
    // Small segments in both directions: multi-segment transfers, partial
    // last segments and per-segment faults are exercised everywhere.
    c.segment_bytes = 64 << 10;
    c.write_segment_bytes = 64 << 10;
    c
}

pub fn open(c: StoreConfig, pool: &Arc<StagingPool>) -> BlockStore {
    BlockStore::open(c, pool.clone()).expect("open store").0
}

/// The pattern a chunk of seed `seed` holds.
pub fn fill_vec(v: &mut [u8], seed: u8) {
    for (j, b) in v.iter_mut().enumerate() {
        *b = (j as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

/// The pattern of `seed` in the first `len` payload bytes of `slot`.
pub fn fill(pool: &StagingPool, slot: usize, len: usize, seed: u8) {
    // SAFETY: the tests fill slots they leased, `len` within the slot size, while no operation uses
    // them.
    let p = unsafe { std::slice::from_raw_parts_mut(pool.payload_ptr(slot), len) };
    fill_vec(p, seed);
}

/// The pattern of `seed`, `len` bytes long.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_vec(&mut v, seed);
    v
}

pub fn payload(pool: &StagingPool, slot: usize, len: usize) -> Vec<u8> {
    // SAFETY: the tests read slots they leased, `len` within the slot size, after their operations
    // completed.
    unsafe { std::slice::from_raw_parts(pool.payload_ptr(slot), len) }.to_vec()
}

pub fn wait(store: &BlockStore, id: OpId) -> pykvcache::Outcome {
    let o = store.wait(id, T).unwrap().expect("operation timed out");
    store.release_op(id);
    o
}

/// Puts `len` bytes of seed `seed` under `key` and gets them back, exactly.
pub fn round_trip(store: &BlockStore, pool: &StagingPool, key: &[u8], len: usize, seed: u8) {
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

pub fn counter(store: &BlockStore, name: &str) -> u64 {
    store.stats().counters().iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no counter {name}")).1
}

/// The chunk file of `key` in the store's first directory.
pub fn chunk_file(store: &BlockStore, key: &[u8]) -> PathBuf {
    let h = pykvcache::key_hash(key);
    store.namespace_dirs()[0].join(format!("{:02x}", (h & 0xff) as u8)).join(format!("{h:032x}.kvc"))
}

/// Temporary files (writes not published) left in the store's directories.
pub fn temp_files(store: &BlockStore) -> Vec<PathBuf> {
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

pub fn inode(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().ino()
}

/// What a reader (LOCK_SH) or a recycler (LOCK_EX) in another process holds: a flock.
pub fn lock(path: &Path, how: i32) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: flock takes no pointer; `f` owns the descriptor and keeps it open.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), how | libc::LOCK_NB) }, 0);
    f
}

/// A filesystem mounted for one test, unmounted when dropped.
pub struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Mounts a `fstype` filesystem at `dir`; None (the test skips, saying so) where
/// this process may not mount.
pub fn mount(fstype: &str, opts: &str, dir: &Path) -> Option<Mount> {
    let ok = Command::new("mount").args(["-t", fstype, "-o", opts, fstype]).arg(dir).status().map(|s| s.success()).unwrap_or(false);
    if !ok {
        eprintln!("cannot mount {fstype} (not root?): skipping");
        return None;
    }
    Some(Mount(dir.to_path_buf()))
}
