//! Writer leases: which processes write a storage root now, so that a store
//! on a local disk walks its directories (and counts what the others write
//! against its capacity) only while it is not alone (decision 0053).
//!
//! Each open store holds one lease file per root, `<root>/.writers/<pid>-<nonce>`,
//! under `flock(LOCK_EX)` for its life, its modification time renewed every
//! `LEASE_BEAT`. Another writer is live when its lease is locked (a shared
//! lock probe fails), or, where locks cannot tell (a filesystem without
//! `flock`, or a lease created a moment ago and not locked yet), when it was
//! renewed within `LEASE_FRESH`. A lease neither locked nor renewed for
//! `LEASE_STALE` belongs to a writer that died without removing it: removed.
//! Checking costs one `readdir` of a few entries and an open + `flock` probe
//! per other lease: cheap enough every second, unlike a walk of the tree.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::disk::layout::create_dir_in;

/// The directory of the leases in each root (not a namespace's name: never scanned as one).
pub const LEASE_DIR: &str = ".writers";
pub const LEASE_BEAT: Duration = Duration::from_secs(5);
pub const LEASE_FRESH: Duration = Duration::from_secs(30);
const LEASE_STALE: Duration = Duration::from_secs(600);

pub struct WriterLease {
    /// Identifies this store's leases (their names end in it) and its record
    /// in the capacity ledger (`disk::ledger`).
    id: u64,
    /// (lease directory, this store's lease file, its open file holding the lock).
    held: Vec<(PathBuf, PathBuf, File)>,
}

impl WriterLease {
    /// Takes a lease in each root. A root where none can be taken (read-only,
    /// full) is skipped and named in the returned notes: other stores do not
    /// see this one there.
    pub fn take(roots: &[PathBuf], dir_mode: u32, file_mode: u32) -> (Self, Vec<String>) {
        Self::take_as(roots, dir_mode, file_mode, nonce())
    }

    /// `take` under a given id: a store taking its leases again (after a
    /// storage directory came back) keeps its id, and so its ledger records.
    pub fn take_as(roots: &[PathBuf], dir_mode: u32, file_mode: u32, id: u64) -> (Self, Vec<String>) {
        let name = format!("{}-{id:016x}", std::process::id());
        let mut held = Vec::new();
        let mut notes = Vec::new();
        for root in roots {
            let dir = root.join(LEASE_DIR);
            let path = dir.join(&name);
            // Never the root itself: a store whose root went away does not make it again.
            let made = create_dir_in(&dir, dir_mode).and_then(|()| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(file_mode)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(&path)
            });
            match made {
                Ok(file) => {
                    // Without flock here, others judge this lease by its renewals.
                    // SAFETY: flock takes no pointer; `file` owns the descriptor and keeps it open.
                    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
                    held.push((dir, path, file));
                }
                Err(e) => notes.push(format!(
                    "no writer lease in {} ({e}): other processes writing there do not see this one, and may exceed \
                     capacity_bytes in total unless they refresh on a timer",
                    dir.display()
                )),
            }
        }
        (WriterLease { id, held }, notes)
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Renews this store's leases (their modification time).
    pub fn beat(&self) {
        for (_, _, file) in &self.held {
            let _ = file.set_modified(SystemTime::now());
        }
    }

    /// When a lease was last created or removed in any root: the lease
    /// directories' modification times. A writer that came and went between two
    /// checks of [`others`](Self::others) (a short job, a second) is never seen
    /// live, but it moves this stamp, so its chunks are still walked into the index.
    pub fn stamp(&self) -> Vec<Option<SystemTime>> {
        self.held.iter().map(|(dir, _, _)| std::fs::metadata(dir).and_then(|m| m.modified()).ok()).collect()
    }

    /// Live leases of other stores (processes or stores in this one), over
    /// every root this store holds a lease in; removes dead writers' leases.
    pub fn others(&self) -> usize {
        let now = SystemTime::now();
        let mut live = 0;
        for (dir, mine, _) in &self.held {
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            for entry in entries.flatten() {
                let path = entry.path();
                if path == *mine || !entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
                    continue;
                }
                match lease_state(&path, now) {
                    LeaseState::Live => live += 1,
                    LeaseState::Dead => {
                        let _ = std::fs::remove_file(&path);
                    }
                    LeaseState::Unknown => {}
                }
            }
        }
        live
    }
}

impl Drop for WriterLease {
    fn drop(&mut self) {
        for (_, path, _) in &self.held {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Whether the writer `id` holds a live lease in `root`: a ledger record of
/// a writer without one is a dead writer's. The ledger is only kept where
/// `flock` works, so an unlocked lease is a dead writer's: unlike `others`,
/// no grace for a recent renewal (a writer killed a second after its last
/// one would count for `LEASE_FRESH` more). Looked at twice, `RELOOK` apart:
/// a lease is created a moment before its writer locks it.
pub fn is_live(root: &Path, id: u64) -> bool {
    const RELOOK: Duration = Duration::from_millis(20);
    let suffix = format!("-{id:016x}");
    let Ok(entries) = std::fs::read_dir(root.join(LEASE_DIR)) else { return false };
    for entry in entries.flatten() {
        if entry.file_name().to_str().is_some_and(|n| n.ends_with(&suffix)) {
            let path = entry.path();
            return locked(&path).unwrap_or(true) || {
                std::thread::sleep(RELOOK);
                locked(&path).unwrap_or(true)
            };
        }
    }
    false
}

/// Whether someone holds `path`'s lock; Some(false) also when it is gone,
/// None where locks cannot tell.
fn locked(path: &Path) -> Option<bool> {
    let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path) else {
        return Some(false);
    };
    // SAFETY: flock on a descriptor `file` owns and keeps open for the call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
        return Some(false); // released with `file`
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EWOULDBLOCK) => Some(true),
        _ => None,
    }
}

enum LeaseState {
    Live,
    /// Neither locked nor renewed for `LEASE_STALE`.
    Dead,
    /// Gone meanwhile, or between fresh and stale.
    Unknown,
}

fn lease_state(path: &Path, now: SystemTime) -> LeaseState {
    let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path) else {
        return LeaseState::Unknown;
    };
    let fd = file.as_raw_fd();
    // SAFETY: flock takes no pointer; `file` owns `fd` and keeps it open.
    if unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) } != 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK) {
            return LeaseState::Live;
        }
        // No flock on this filesystem: the renewals tell.
    } else {
        // SAFETY: as above.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
    }
    let age = file.metadata().and_then(|m| m.modified()).map(|t| now.duration_since(t).unwrap_or_default());
    match age {
        Ok(age) if age <= LEASE_FRESH => LeaseState::Live,
        Ok(age) if age > LEASE_STALE => LeaseState::Dead,
        _ => LeaseState::Unknown,
    }
}

/// Distinguishes stores of one process, and processes of one pid on several nodes.
fn nonce() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut host = [0u8; 256];
    // SAFETY: `host` is 256 writable bytes and its length is passed: gethostname writes no more (a
    // truncated name may lack its NUL; it is only hashed).
    unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len()) };
    let mut seed = Vec::with_capacity(300);
    seed.extend_from_slice(&t.to_le_bytes());
    seed.extend_from_slice(&n.to_le_bytes());
    seed.extend_from_slice(&std::process::id().to_le_bytes());
    seed.extend_from_slice(&host);
    xxhash_rust::xxh3::xxh3_64(&seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_sees_another_live_lease_and_not_its_own() {
        let tmp = tempfile::tempdir().unwrap();
        let roots = vec![tmp.path().to_path_buf()];
        let (a, notes) = WriterLease::take(&roots, 0o700, 0o600);
        assert!(notes.is_empty());
        assert_eq!(a.others(), 0, "alone");
        let (b, _) = WriterLease::take(&roots, 0o700, 0o600);
        assert_eq!((a.others(), b.others()), (1, 1));
        drop(b);
        assert_eq!(a.others(), 0, "a closed store's lease is gone");
    }

    #[test]
    fn an_unlocked_lease_counts_while_renewed_and_is_removed_when_stale() {
        let tmp = tempfile::tempdir().unwrap();
        let roots = vec![tmp.path().to_path_buf()];
        let (a, _) = WriterLease::take(&roots, 0o700, 0o600);
        // A dead writer's lease: no lock, renewed just now, then long ago.
        let dead = tmp.path().join(LEASE_DIR).join("1-dead");
        let f = std::fs::File::create(&dead).unwrap();
        assert_eq!(a.others(), 1, "renewed within LEASE_FRESH: live (a filesystem without flock)");
        f.set_modified(SystemTime::now() - LEASE_FRESH * 2).unwrap();
        assert_eq!(a.others(), 0);
        assert!(dead.exists(), "not stale yet: kept");
        f.set_modified(SystemTime::now() - LEASE_STALE * 2).unwrap();
        assert_eq!(a.others(), 0);
        assert!(!dead.exists(), "a stale, unlocked lease is removed");
    }

    #[test]
    fn a_scan_leaves_a_live_writers_unlocked_temp_file_and_removes_an_orphan() {
        use crate::disk::files::{remove_if_writer_gone, temp_owner};
        let tmp = tempfile::tempdir().unwrap();
        let roots = vec![tmp.path().to_path_buf()];
        let (live, _) = WriterLease::take(&roots, 0o700, 0o600);
        let mut owner_live = |id| is_live(tmp.path(), id);
        // Another process's names (pid 1): just created, not locked yet.
        let theirs = format!(".tmp-1-0-w{:016x}", live.id());
        let orphan = format!(".tmp-1-1-w{:016x}", live.id() ^ 1);
        let legacy = ".tmp-1-2".to_string();
        assert_eq!((temp_owner(&theirs), temp_owner(&legacy), temp_owner(".tmp-1-3-wxyz")), (Some(live.id()), None, None));
        for name in [&theirs, &orphan, &legacy] {
            std::fs::File::create(tmp.path().join(name)).unwrap();
        }
        assert!(!remove_if_writer_gone(&tmp.path().join(&theirs), &theirs, &mut owner_live), "its writer's lease is live");
        assert!(remove_if_writer_gone(&tmp.path().join(&orphan), &orphan, &mut owner_live), "no lease, no lock: an orphan");
        assert!(remove_if_writer_gone(&tmp.path().join(&legacy), &legacy, &mut owner_live), "no owner named, no lock");
        drop(live);
        assert!(remove_if_writer_gone(&tmp.path().join(&theirs), &theirs, &mut owner_live), "its writer closed");
    }
}
