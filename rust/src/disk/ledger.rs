//! The capacity ledger of a storage root: how many bytes every writer sharing
//! the root holds there, kept in one small file under an exclusive `flock`
//! (decision 0053). A walk of the tree tells a writer what the others *wrote*,
//! seconds late; the ledger tells it what they hold *now*, puts in flight
//! included, so that several writers evict before they write instead of
//! after they find out (two writers at full speed held 2x the capacity).
//!
//! `<root>/.capacity-ledger`, one 4 KiB block (O_DIRECT on network and FUSE
//! filesystems, so that another node's last write is what is read):
//! - `published`: bytes of chunk files under the root, every namespace,
//!   as the writers that published and removed them counted;
//! - one record per live writer: its id (its lease's) and the bytes of its
//!   puts in flight (room taken, not yet published), so that a writer that
//!   dies leaves nothing behind once its lease is found dead.
//!
//! The total the capacity bounds is `published` + every record's bytes.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

pub const LEDGER_FILE: &str = ".capacity-ledger";
const MAGIC: [u8; 8] = *b"PKVLDG01";
const BLOCK: usize = 4096;
const HEAD: usize = 24;
/// Writers one ledger can record (each 16 bytes after the 24-byte head).
pub const MAX_WRITERS: usize = (BLOCK - HEAD) / 16;

/// A block aligned for O_DIRECT.
#[repr(C, align(4096))]
struct Block([u8; BLOCK]);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerState {
    /// False for a ledger nobody has counted yet (a new file).
    pub counted: bool,
    pub published: u64,
    /// (writer id, bytes of its puts in flight).
    pub writers: Vec<(u64, u64)>,
}

impl LedgerState {
    /// Bytes held: published plus every writer's puts in flight.
    #[cfg(test)]
    pub fn total(&self) -> u64 {
        self.writers.iter().fold(self.published, |t, (_, b)| t.saturating_add(*b))
    }

    /// Sets writer `id`'s bytes in flight (0 drops its record).
    pub fn set_writer(&mut self, id: u64, bytes: u64) {
        self.writers.retain(|(w, _)| *w != id);
        if bytes > 0 || self.writers.len() < MAX_WRITERS {
            self.writers.push((id, bytes));
        }
    }

    fn decode(b: &[u8; BLOCK]) -> Self {
        let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        if b[..8] != MAGIC {
            return LedgerState::default();
        }
        let n = (u(16) as usize).min(MAX_WRITERS);
        let writers = (0..n).map(|i| (u(HEAD + 16 * i), u(HEAD + 16 * i + 8))).collect();
        LedgerState { counted: true, published: u(8), writers }
    }

    fn encode(&self, b: &mut [u8; BLOCK]) {
        b.fill(0);
        b[..8].copy_from_slice(&MAGIC);
        b[8..16].copy_from_slice(&self.published.to_le_bytes());
        let n = self.writers.len().min(MAX_WRITERS);
        b[16..24].copy_from_slice(&(n as u64).to_le_bytes());
        for (i, (id, bytes)) in self.writers.iter().take(n).enumerate() {
            b[HEAD + 16 * i..HEAD + 16 * i + 8].copy_from_slice(&id.to_le_bytes());
            b[HEAD + 16 * i + 8..HEAD + 16 * i + 16].copy_from_slice(&bytes.to_le_bytes());
        }
    }
}

/// One root's ledger file, open for this store's life.
pub struct Ledger {
    path: PathBuf,
    /// The file and its I/O block. The mutex orders this process's threads
    /// (a `flock` on one open file does not); the `flock` orders processes.
    inner: Mutex<(File, Box<Block>)>,
}

/// The ledger locked (thread and process), its state as read under the lock.
pub struct LedgerGuard<'a> {
    inner: MutexGuard<'a, (File, Box<Block>)>,
    pub state: LedgerState,
}

fn flock(file: &File, how: i32) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor this `File` owns and keeps open.
        if unsafe { libc::flock(file.as_raw_fd(), how) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

impl Ledger {
    /// Opens the ledger of `root`, with `create` creating the file (never a
    /// directory). Refused where `flock` does not work: the ledger means
    /// nothing unlocked.
    pub fn open(root: &Path, mode: u32, direct: bool, create: bool) -> std::io::Result<Self> {
        let path = root.join(LEDGER_FILE);
        let open = |direct: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(create)
                .mode(mode)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | if direct { libc::O_DIRECT } else { 0 })
                .open(&path)
        };
        let file = match open(direct) {
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => open(false)?,
            other => other?,
        };
        if !file.metadata()?.is_file() {
            return Err(std::io::Error::other(format!("{} is not a regular file", path.display())));
        }
        flock(&file, libc::LOCK_EX | libc::LOCK_NB).or_else(|e| match e.raw_os_error() {
            // Held by another writer right now: flock works here.
            Some(libc::EWOULDBLOCK) => Ok(()),
            _ => Err(e),
        })?;
        flock(&file, libc::LOCK_UN)?;
        Ok(Ledger { path, inner: Mutex::new((file, Box::new(Block([0; BLOCK])))) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Locks the ledger (waits for the other writers' short transactions)
    /// and reads it.
    pub fn lock(&self) -> std::io::Result<LedgerGuard<'_>> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        flock(&inner.0, libc::LOCK_EX)?;
        match read(&mut inner) {
            Ok(state) => Ok(LedgerGuard { inner, state }),
            Err(e) => {
                let _ = flock(&inner.0, libc::LOCK_UN);
                Err(e)
            }
        }
    }

    /// The state without the process lock: for a look at another root's
    /// total (a moment old is good enough there).
    pub fn peek(&self) -> std::io::Result<LedgerState> {
        read(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether the open file is no longer the one at the ledger's path
    /// (removed with its root, or replaced): the caller opens it again.
    pub fn detached(&self) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Ok(open) = inner.0.metadata() else { return true };
        match std::fs::symlink_metadata(&self.path) {
            Ok(now) => open.nlink() == 0 || now.ino() != open.ino() || now.dev() != open.dev(),
            Err(_) => true,
        }
    }
}

fn read(inner: &mut (File, Box<Block>)) -> std::io::Result<LedgerState> {
    let (file, block) = inner;
    let n = file.read_at(&mut block.0, 0)?;
    if n < BLOCK {
        return Ok(LedgerState::default()); // a new, empty file
    }
    Ok(LedgerState::decode(&block.0))
}

impl LedgerGuard<'_> {
    /// Writes the state back (still locked until the guard drops).
    pub fn write(&mut self) -> std::io::Result<()> {
        self.state.counted = true;
        let (file, block) = &mut *self.inner;
        self.state.encode(&mut block.0);
        let n = file.write_at(&block.0, 0)?;
        if n != BLOCK {
            return Err(std::io::Error::other(format!("short write of the capacity ledger: {n} bytes")));
        }
        Ok(())
    }
}

impl Drop for LedgerGuard<'_> {
    fn drop(&mut self) {
        let _ = flock(&self.inner.0, libc::LOCK_UN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_round_trips_and_a_new_file_is_uncounted() {
        let tmp = tempfile::tempdir().unwrap();
        let a = Ledger::open(tmp.path(), 0o600, true, true).unwrap();
        let b = Ledger::open(tmp.path(), 0o600, false, true).unwrap();
        {
            let mut g = a.lock().unwrap();
            assert_eq!(g.state, LedgerState::default());
            g.state.published = 1000;
            g.state.set_writer(7, 64);
            g.state.set_writer(9, 0);
            g.write().unwrap();
        }
        let s = b.lock().unwrap().state.clone();
        assert!(s.counted);
        assert_eq!((s.published, s.total()), (1000, 1064));
        assert_eq!(s.writers, vec![(7, 64), (9, 0)]);
        assert_eq!(b.peek().unwrap(), s);
        assert!(!a.detached());
        std::fs::remove_file(tmp.path().join(LEDGER_FILE)).unwrap();
        assert!(a.detached());
    }

    #[test]
    fn two_open_files_exclude_each_other() {
        let tmp = tempfile::tempdir().unwrap();
        let a = std::sync::Arc::new(Ledger::open(tmp.path(), 0o600, false, true).unwrap());
        let b = Ledger::open(tmp.path(), 0o600, false, true).unwrap();
        // Each adds 1 to `published` 200 times, from two threads with two open files.
        std::thread::scope(|s| {
            for ledger in [&*a, &b] {
                s.spawn(move || {
                    for _ in 0..200 {
                        let mut g = ledger.lock().unwrap();
                        g.state.published += 1;
                        g.write().unwrap();
                    }
                });
            }
        });
        assert_eq!(a.peek().unwrap().published, 400);
    }
}
