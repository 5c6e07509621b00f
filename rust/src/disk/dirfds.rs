//! Directory descriptors held open, so that a chunk file is reached by its
//! name relative to its shard directory (`openat`, `fstatat`, `renameat`,
//! `unlinkat`) instead of through its whole path.
//!
//! On a local filesystem a path walk is a few dentry-cache hits. On a network
//! filesystem that caches no entries (the GlusterFS client with
//! `--entry-timeout=0`, NFS with `lookupcache=none`, what strict consistency
//! between nodes asks for) every component of every path is revalidated by a
//! round trip: `<root>/<namespace>/<shard>/<file>` costs a LOOKUP per
//! component before the operation itself, and a put or a get makes several
//! such calls. From a held descriptor only the last name is looked up.
//!
//! A held descriptor outlives what its path named. Its directory may be
//! removed (`rm -rf` of the store, another node's cleanup) and made again at
//! the same path: every name operation in a removed directory fails with
//! ENOENT, so an ENOENT or ESTALE makes this module look at the directory
//! itself (one `fstat`: gone, or no links left); a dead one is forgotten,
//! opened again by path, and the operation tried once more. What no name
//! operation can notice (a filesystem unmounted from under the path) is the
//! breaker's: the store forgets every held descriptor of a root when its
//! breaker opens and when the root comes back (`forget_all`).
//!
//! Bounded: at most `MAX_HELD` descriptors (a root's namespace has 256 shard
//! directories); when full the table is emptied and refilled on use. A
//! descriptor is closed when the last operation using it ends (`Arc`).

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Directories held per store; beyond it the table starts again.
const MAX_HELD: usize = 4096;

#[derive(Default)]
pub struct HeldDirs {
    held: Mutex<HashMap<PathBuf, Arc<OwnedFd>>>,
}

fn cname(name: &std::ffi::OsStr) -> std::io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

/// `path`'s directory and last component.
fn split(path: &Path) -> std::io::Result<(&Path, CString)> {
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => Ok((dir, cname(name)?)),
        _ => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
    }
}

fn retry_eintr<T>(mut call: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    loop {
        match call() {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            other => return other,
        }
    }
}

fn check(rc: libc::c_int) -> std::io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// ENOENT or ESTALE: the name is not there, or the directory itself may be gone.
fn not_found(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESTALE))
}

/// The held directory was removed: it cannot be stat'ed, or has no links.
fn removed(fd: RawFd) -> bool {
    // SAFETY: stat is plain data, for which all-zero bytes are a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a writable stat that lives across the call; `fd` is held open by the caller.
    unsafe { libc::fstat(fd, &mut st) != 0 || st.st_nlink == 0 }
}

impl HeldDirs {
    /// The held descriptor of `dir`, opened the first time: from its
    /// parent's where that is held (a namespace directory's shards: one
    /// lookup), else by its path (a walk).
    fn get(&self, dir: &Path) -> std::io::Result<Arc<OwnedFd>> {
        let parent = {
            let held = self.held.lock().unwrap();
            if let Some(fd) = held.get(dir) {
                return Ok(fd.clone());
            }
            dir.parent().and_then(|p| held.get(p).cloned())
        };
        // O_PATH: a handle for *at calls and fstat, no permission to read the
        // listing needed, nothing the filesystem has to open.
        let how = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NOFOLLOW;
        let from_parent = match (&parent, dir.file_name()) {
            (Some(p), Some(name)) => Some(open_at(p.as_raw_fd(), &cname(name)?, how, 0)),
            _ => None,
        };
        let raw = match from_parent {
            Some(Ok(fd)) => fd,
            // The held parent may be dead, or the name a symlink: by path (what it names now).
            _ => {
                let c = cname(dir.as_os_str())?;
                retry_eintr(|| {
                    // SAFETY: `c` is a NUL-terminated path that lives across the call.
                    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
                    if fd >= 0 {
                        Ok(fd)
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                })?
            }
        };
        // SAFETY: `raw` was just opened and nothing else owns it.
        let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let mut held = self.held.lock().unwrap();
        if held.len() >= MAX_HELD {
            held.clear();
        }
        Ok(held.entry(dir.to_path_buf()).or_insert(fd).clone())
    }

    /// Forgets `dir`'s descriptor if it is still `stale` (another thread may have replaced it).
    fn forget(&self, dir: &Path, stale: &Arc<OwnedFd>) {
        let mut held = self.held.lock().unwrap();
        if held.get(dir).is_some_and(|fd| Arc::ptr_eq(fd, stale)) {
            held.remove(dir);
        }
    }

    /// Holds `dir` (a namespace directory) so that the directories in it are
    /// opened from it.
    pub fn hold(&self, dir: &Path) {
        let _ = self.get(dir);
    }

    /// Forgets every held descriptor under `root` (its breaker opened, or it came back).
    pub fn forget_all(&self, root: &Path) {
        self.held.lock().unwrap().retain(|dir, _| !dir.starts_with(root));
    }

    /// Runs `op` on `dir`'s descriptor; once more on a fresh one when it
    /// found nothing because the held directory was removed.
    fn in_dir<T>(&self, dir: &Path, op: impl Fn(RawFd) -> std::io::Result<T>) -> std::io::Result<T> {
        let fd = self.get(dir)?;
        match op(fd.as_raw_fd()) {
            Err(e) if not_found(&e) && removed(fd.as_raw_fd()) => {
                self.forget(dir, &fd);
                op(self.get(dir)?.as_raw_fd())
            }
            other => other,
        }
    }

    /// `open(path)` as `openat` from its directory; O_CLOEXEC and O_NOFOLLOW
    /// always (a symlink planted at a chunk path is never followed).
    pub fn open(&self, path: &Path, flags: i32, mode: u32) -> std::io::Result<RawFd> {
        let (dir, name) = split(path)?;
        self.in_dir(dir, |d| open_at(d, &name, flags, mode))
    }

    /// `lstat(path)` as `fstatat(AT_SYMLINK_NOFOLLOW)` from its directory.
    pub fn lstat(&self, path: &Path) -> std::io::Result<libc::stat> {
        let (dir, name) = split(path)?;
        self.in_dir(dir, |d| lstat_at(d, &name))
    }

    /// `lstat` where an absent name is the expected answer (a publish's
    /// look before its rename): no look at the directory behind an ENOENT;
    /// the operation that follows finds a dead directory.
    pub fn lstat_once(&self, path: &Path) -> std::io::Result<libc::stat> {
        let (dir, name) = split(path)?;
        lstat_at(self.get(dir)?.as_raw_fd(), &name)
    }

    /// `unlink(path)` as `unlinkat` from its directory.
    pub fn unlink(&self, path: &Path) -> std::io::Result<()> {
        let (dir, name) = split(path)?;
        // SAFETY: `name` is NUL-terminated and lives across the call.
        self.in_dir(dir, |d| check(unsafe { libc::unlinkat(d, name.as_ptr(), 0) }))
    }

    /// `rename(from, to)` (or `renameat2` with `flags`) between the held
    /// directories of both. Tried again only when the first failed for a
    /// removed directory.
    pub fn rename(&self, from: &Path, to: &Path, flags: libc::c_uint) -> std::io::Result<()> {
        let ((src_dir, src), (dst_dir, dst)) = (split(from)?, split(to)?);
        let call = |s: RawFd, d: RawFd| {
            // SAFETY: both names are NUL-terminated and live across the call.
            let rc = unsafe {
                if flags == 0 {
                    libc::renameat(s, src.as_ptr(), d, dst.as_ptr())
                } else {
                    libc::renameat2(s, src.as_ptr(), d, dst.as_ptr(), flags)
                }
            };
            check(rc)
        };
        let (s, d) = (self.get(src_dir)?, self.get(dst_dir)?);
        match call(s.as_raw_fd(), d.as_raw_fd()) {
            Err(e) if not_found(&e) && (removed(s.as_raw_fd()) || removed(d.as_raw_fd())) => {
                self.forget(src_dir, &s);
                self.forget(dst_dir, &d);
                call(self.get(src_dir)?.as_raw_fd(), self.get(dst_dir)?.as_raw_fd())
            }
            other => other,
        }
    }

    /// `statvfs(dir)` as `fstatvfs` of its held descriptor.
    pub fn statvfs(&self, dir: &Path) -> std::io::Result<libc::statvfs> {
        self.in_dir(dir, |fd| {
            // SAFETY: statvfs is plain data, for which all-zero bytes are a valid value.
            let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
            // SAFETY: `st` is writable and lives across the call; `fd` is held open.
            check(unsafe { libc::fstatvfs(fd, &mut st) })?;
            Ok(st)
        })
    }
}

fn lstat_at(dir: RawFd, name: &CStr) -> std::io::Result<libc::stat> {
    // SAFETY: stat is plain data, for which all-zero bytes are a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `name` is NUL-terminated and `st` writable; both live across the call.
    check(unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

fn open_at(dir: RawFd, name: &CStr, flags: i32, mode: u32) -> std::io::Result<RawFd> {
    retry_eintr(|| {
        // SAFETY: `name` is NUL-terminated and lives across the call; the caller owns the
        // descriptor returned.
        let fd = unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOFOLLOW, mode) };
        if fd >= 0 {
            Ok(fd)
        } else {
            Err(std::io::Error::last_os_error())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(fd: RawFd) {
        // SAFETY: `fd` was just opened by the test and is owned by nothing else.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }

    #[test]
    fn a_directory_removed_and_made_again_is_opened_again() {
        let tmp = std::env::temp_dir().join(format!("pykvcache-dirfds-{}", std::process::id()));
        let dir = tmp.join("shard");
        std::fs::create_dir_all(&dir).unwrap();
        let held = HeldDirs::default();
        let file = dir.join("a");
        let fd = held.open(&file, libc::O_CREAT | libc::O_WRONLY, 0o600).unwrap();
        close(fd);
        assert!(held.lstat(&file).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        // The held descriptor names the removed directory: found dead, opened again.
        let fd = held.open(&file, libc::O_CREAT | libc::O_WRONLY, 0o600).unwrap();
        close(fd);
        assert!(file.exists(), "created in the directory now at the path");
        held.rename(&file, &dir.join("b"), 0).unwrap();
        assert_eq!(held.lstat(&file).unwrap_err().raw_os_error(), Some(libc::ENOENT));
        held.unlink(&dir.join("b")).unwrap();
        assert!(held.statvfs(&dir).unwrap().f_bsize > 0);
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn a_symlink_at_a_name_is_not_followed_and_the_table_stays_bounded() {
        let tmp = std::env::temp_dir().join(format!("pykvcache-dirfds-b-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", tmp.join("link")).unwrap();
        let held = HeldDirs::default();
        assert_eq!(held.open(&tmp.join("link"), libc::O_RDONLY, 0).unwrap_err().raw_os_error(), Some(libc::ELOOP));
        for i in 0..MAX_HELD + 3 {
            let d = tmp.join(format!("d{i}"));
            std::fs::create_dir(&d).unwrap();
            assert_eq!(held.lstat(&d.join("x")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
        }
        assert!(held.held.lock().unwrap().len() <= MAX_HELD);
        held.forget_all(&tmp);
        assert!(held.held.lock().unwrap().is_empty());
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
