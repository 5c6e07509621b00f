//! File operations around a transfer: opening with the direct-I/O policy,
//! publishing a written chunk atomically, dropping cached pages after
//! buffered I/O, and probing what a filesystem supports.

use std::os::fd::RawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{EngineError, Result};
use crate::format::IO_ALIGN;
use crate::layout::{cstring, TEMP_PREFIX};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectIoPolicy {
    /// Fail if the filesystem refuses O_DIRECT.
    Required,
    /// Use O_DIRECT where possible, buffered I/O (with page-cache drop) otherwise.
    Optional,
    /// Always buffered.
    Disabled,
}

impl DirectIoPolicy {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "required" => Ok(Self::Required),
            "optional" => Ok(Self::Optional),
            "disabled" => Ok(Self::Disabled),
            other => Err(EngineError::invalid(format!("direct_io must be required|optional|disabled, not {other:?}"))),
        }
    }
}

/// What one directory's filesystem supports, found by trying it.
#[derive(Clone, Copy, Debug)]
pub struct FsSupport {
    pub direct: bool,
    pub tmpfile: bool,
}

/// A file opened for writing a new chunk, not yet visible under its name.
pub struct PendingFile {
    pub fd: RawFd,
    /// Set when O_TMPFILE was unavailable and a named temporary file is used.
    pub temp_path: Option<std::path::PathBuf>,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn open_raw(path: &Path, flags: i32, mode: u32) -> std::io::Result<RawFd> {
    let c = cstring(path).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    loop {
        let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOFOLLOW, mode) };
        if fd >= 0 {
            return Ok(fd);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

fn direct_flag(direct: bool) -> i32 {
    if direct { libc::O_DIRECT } else { 0 }
}

/// Opens a chunk for reading: the fd and, for a regular file, its size.
/// Anything else (FIFO, device, ...) comes back with no size, for the caller
/// to reject; it is never switched to O_DIRECT or read.
pub fn open_for_read(path: &Path, direct: bool) -> std::io::Result<(RawFd, Option<u64>)> {
    // O_NONBLOCK so that opening a FIFO planted at a chunk path cannot hang;
    // O_DIRECT only once the file is known to be regular (a FIFO refuses it).
    let fd = open_raw(path, libc::O_RDONLY | libc::O_NONBLOCK, 0)?;
    let size = match regular_file_size(fd) {
        Ok(size) => size,
        Err(e) => {
            close(fd);
            return Err(e);
        }
    };
    if size.is_some() {
        // io_uring honours O_NONBLOCK on regular files too: clear it.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        let wanted = (flags & !libc::O_NONBLOCK) | direct_flag(direct);
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, wanted) } < 0 {
            let e = std::io::Error::last_os_error();
            close(fd);
            return Err(e);
        }
    }
    Ok((fd, size))
}

pub fn open_for_write(dir: &Path, support: FsSupport, direct: bool, mode: u32) -> std::io::Result<PendingFile> {
    if support.tmpfile {
        let fd = open_raw(dir, libc::O_TMPFILE | libc::O_WRONLY | direct_flag(direct), mode)?;
        return Ok(PendingFile { fd, temp_path: None });
    }
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let temp = dir.join(format!("{TEMP_PREFIX}{}-{n}", std::process::id()));
    let fd = open_raw(&temp, libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | direct_flag(direct), mode)?;
    // Held until the file is published or discarded; the kernel drops it when
    // the writer dies, which is how a scan tells an orphan from a live write.
    unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) };
    Ok(PendingFile { fd, temp_path: Some(temp) })
}

/// Whether the temporary file `name` at `path` was left by a dead writer:
/// nobody holds its lock. Our own files are skipped (network filesystems
/// emulate flock with per-process locks, which we would always get).
pub fn temp_writer_gone(path: &Path, name: &str) -> bool {
    if name.starts_with(&format!("{TEMP_PREFIX}{}-", std::process::id())) {
        return false;
    }
    let Ok(fd) = open_raw(path, libc::O_RDONLY | libc::O_NONBLOCK, 0) else { return false };
    let unlocked = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0;
    close(fd);
    unlocked
}

/// Makes a completely written file visible under `final_path`.
/// Returns Ok(false) when another writer published the same chunk first.
pub fn publish(file: &PendingFile, final_path: &Path) -> std::io::Result<bool> {
    let dst = cstring(final_path).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    if let Some(temp) = &file.temp_path {
        let src = cstring(temp).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // rename replaces an existing chunk of the same key: same content, harmless.
        if unsafe { libc::rename(src.as_ptr(), dst.as_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        return Ok(true);
    }
    // linkat through /proc avoids needing CAP_DAC_READ_SEARCH for AT_EMPTY_PATH.
    let src = std::ffi::CString::new(format!("/proc/self/fd/{}", file.fd)).unwrap();
    let rc = unsafe { libc::linkat(libc::AT_FDCWD, src.as_ptr(), libc::AT_FDCWD, dst.as_ptr(), libc::AT_SYMLINK_FOLLOW) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EEXIST) {
        return Ok(false);
    }
    Err(e)
}

pub fn discard(file: &PendingFile) {
    if let Some(temp) = &file.temp_path {
        let _ = std::fs::remove_file(temp);
    }
    close(file.fd);
}

pub fn close(fd: RawFd) {
    unsafe { libc::close(fd) };
}

/// Size of a regular file; None for anything else (FIFO, device, ...).
pub fn regular_file_size(fd: RawFd) -> std::io::Result<Option<u64>> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.st_mode & libc::S_IFMT == libc::S_IFREG).then_some(st.st_size as u64))
}

/// After buffered I/O, keep the page cache from filling with chunk data
/// (the staging pool is the cache; double caching only evicts useful pages).
pub fn drop_cached_pages(fd: RawFd, written: bool) {
    unsafe {
        if written {
            libc::sync_file_range(fd, 0, 0, libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER);
        }
        libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Finds out whether `dir` supports O_TMPFILE and O_DIRECT by doing it:
/// an aligned 4 KiB direct write, not just an accepted flag.
pub fn probe(dir: &Path, mode: u32) -> FsSupport {
    let tmpfile = match open_raw(dir, libc::O_TMPFILE | libc::O_RDWR, mode) {
        Ok(fd) => {
            close(fd);
            true
        }
        Err(_) => false,
    };
    let probe_path = dir.join(format!("{TEMP_PREFIX}probe-{}-{}", std::process::id(), TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)));
    let direct = match open_raw(&probe_path, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_DIRECT, mode) {
        Ok(fd) => {
            let layout = std::alloc::Layout::from_size_align(IO_ALIGN, IO_ALIGN).unwrap();
            let buf = unsafe { std::alloc::alloc_zeroed(layout) };
            let n = unsafe { libc::pwrite(fd, buf as *const _, IO_ALIGN, 0) };
            let m = unsafe { libc::pread(fd, buf as *mut _, IO_ALIGN, 0) };
            unsafe { std::alloc::dealloc(buf, layout) };
            close(fd);
            n == IO_ALIGN as isize && m == IO_ALIGN as isize
        }
        Err(_) => false,
    };
    let _ = std::fs::remove_file(&probe_path);
    FsSupport { direct, tmpfile }
}
