//! File operations around a transfer: opening with the direct-I/O policy,
//! publishing a written chunk atomically, dropping cached pages after
//! buffered I/O, and probing what a filesystem supports.

use std::os::fd::RawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::disk::dirfds::HeldDirs;
use crate::disk::format::IO_ALIGN;
use crate::disk::layout::{cstring, TEMP_PREFIX};
use crate::error::Result;

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
    /// The accepted names, in the order of the variants (`_core.DIRECT_IO_POLICIES`).
    pub const CHOICES: [&'static str; 3] = ["required", "optional", "disabled"];
    const ALL: [Self; 3] = [Self::Required, Self::Optional, Self::Disabled];

    pub fn parse(s: &str) -> Result<Self> {
        crate::error::parse_choice("direct_io", s, &Self::CHOICES, &Self::ALL)
    }
}

/// What one directory's filesystem supports, found by trying it.
#[derive(Clone, Copy, Debug)]
pub struct FsSupport {
    pub direct: bool,
    pub tmpfile: bool,
    pub fallocate: bool,
    /// An unaligned O_DIRECT write was accepted (NFS, FUSE): O_DIRECT does
    /// not enforce alignment there. Harmless (every transfer is aligned), recorded.
    pub direct_unaligned: bool,
    /// `fcntl(F_SETFL, O_DIRECT)` on an open file shows in `F_GETFL`. Not
    /// relied on either way (GPFS accepts it and ignores it): chunk files are
    /// opened with O_DIRECT from the start.
    pub direct_set_after_open: bool,
    /// `renameat2(RENAME_NOREPLACE)` works here. GlusterFS's FUSE client
    /// refuses it (EINVAL) after walking both paths (18 FUSE operations on
    /// the suite's volume): where it cannot work, publish does not ask.
    pub rename_noreplace: bool,
    /// `fallocate(PUNCH_HOLE)` frees a range (segment files free an evicted slot so).
    pub punch_hole: bool,
}

/// A file opened for writing a new chunk, not yet visible under its name.
pub struct PendingFile {
    pub fd: RawFd,
    /// Set when O_TMPFILE was unavailable and a named temporary file is used.
    pub temp_path: Option<std::path::PathBuf>,
    /// Its length when opened: 0 for a new file, a recycled one's (at most the new chunk's).
    pub size: u64,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn open_raw(path: &Path, flags: i32, mode: u32) -> std::io::Result<RawFd> {
    let c = cstring(path).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    loop {
        // SAFETY: `c` is a NUL-terminated path that lives across the call; the caller owns the
        // descriptor returned.
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
    if direct {
        libc::O_DIRECT
    } else {
        0
    }
}

/// Opens a chunk for reading: the fd and, for a regular file, its size.
/// Anything else (FIFO, device, ...) comes back with no size, for the caller
/// to reject; it is never switched to O_DIRECT or read.
///
/// A regular file is read under a shared `flock`: evicted files are recycled
/// (see `take_for_reuse`), and a recycler overwrites a file only while it
/// holds the exclusive lock, so a file being recycled comes back as `ENOENT`
/// (a miss) and one locked here is never overwritten while it is read. A file
/// recycled between this open and the lock holds another chunk, complete:
/// its header names that chunk's key, which the read's verdict refuses, and
/// only then is the path looked at again (`still_at`: a file moved away is a
/// miss, not a corrupt chunk to delete). Looking at the path after every lock
/// instead cost each get two round trips on a network filesystem.
pub fn open_for_read(dirs: &HeldDirs, path: &Path, direct: bool) -> std::io::Result<(RawFd, Option<u64>)> {
    // O_NONBLOCK so that opening a FIFO planted at a chunk path cannot hang.
    // O_DIRECT from the start: some filesystems (GPFS) ignore it when set
    // later with fcntl. What refuses it at open (a FIFO, a device, a file
    // system without direct I/O) is opened again without it, to be judged.
    let fd = match dirs.open(path, libc::O_RDONLY | libc::O_NONBLOCK | direct_flag(direct), 0) {
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => dirs.open(path, libc::O_RDONLY | libc::O_NONBLOCK, 0)?,
        other => other?,
    };
    let checked = fstat(fd).and_then(|st| {
        let size = regular_size(&st);
        if size.is_some() {
            // SAFETY: flock takes no pointer; `fd` was opened above.
            if unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                // Held exclusively: being recycled. Without flock (ENOLCK,
                // EOPNOTSUPP) recyclers never get theirs either: read unlocked.
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(gone());
                }
            }
            set_blocking(fd, direct)?;
        }
        Ok(size)
    });
    match checked {
        Ok(size) => Ok((fd, size)),
        Err(e) => {
            close(fd);
            Err(e)
        }
    }
}

/// Whether `path` still names the open file `fd` (not moved away, replaced
/// or removed since it was opened).
pub fn still_at(dirs: &HeldDirs, fd: RawFd, path: &Path) -> bool {
    match (fstat(fd), dirs.lstat(path)) {
        (Ok(open), Ok(now)) => open.st_dev == now.st_dev && open.st_ino == now.st_ino,
        _ => false,
    }
}

/// Clears O_NONBLOCK (io_uring honours it on regular files too) and sets the
/// direct-I/O flag.
fn set_blocking(fd: RawFd, direct: bool) -> std::io::Result<()> {
    // SAFETY: F_GETFL takes no pointer; `fd` is the caller's open descriptor.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    let wanted = (flags & !libc::O_NONBLOCK) | direct_flag(direct);
    // SAFETY: F_SETFL takes an int, no pointer.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, wanted) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn gone() -> std::io::Error {
    std::io::Error::from_raw_os_error(libc::ENOENT)
}

/// Takes `how` (LOCK_SH/LOCK_EX) without waiting, then checks that `path`
/// still names the locked file, `st` (the open file's `fstat`: its device and
/// inode are the file's for as long as it is open). A lock held by someone else, or a file moved
/// away, is `ENOENT`. Filesystems without flock (`ENOLCK`, `EOPNOTSUPP`)
/// give readers no lock: recyclers there never get theirs, so never overwrite.
fn lock_if_current(dirs: &HeldDirs, fd: RawFd, st: &libc::stat, path: &Path, how: i32) -> std::io::Result<()> {
    // SAFETY: flock takes no pointer; `fd` is the caller's open descriptor.
    if unsafe { libc::flock(fd, how | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => Err(gone()),
            _ if how == libc::LOCK_SH => Ok(()),
            _ => Err(e),
        };
    }
    match dirs.lstat(path) {
        Ok(m) if m.st_dev == st.st_dev && m.st_ino == st.st_ino => Ok(()),
        _ => Err(gone()),
    }
}

/// Takes an evicted chunk file for a new chunk instead of unlinking it:
/// overwriting allocated blocks skips the block allocation and metadata
/// journaling a fresh file costs (ext4: ~25% of write bandwidth).
///
/// The victim is first renamed to a private temp name in `dir` (atomic: of
/// several processes evicting the same file, one gets it), then locked
/// exclusively -- which fails while any reader holds its shared lock -- and
/// checked to still be that name. Until published it is a temp file locked by
/// its writer, so a crash leaves an orphan the next scan removes, never a
/// half-written file under a chunk name. On failure the victim is gone from
/// its chunk path either way (it was evicted) and the caller writes a fresh file.
///
/// This first step, the rename, decides whose the file is; `open_taken` does
/// the rest. On failure the flag says whether this call took the victim off
/// its path all the same (unlinked it): false when another process had
/// removed it first, whose removal the capacity ledger counted then.
pub fn take_for_reuse(
    dirs: &HeldDirs,
    victim: &Path,
    dir: &Path,
    owner: u64,
) -> std::result::Result<std::path::PathBuf, (std::io::Error, bool)> {
    let temp = temp_name(dir, owner);
    if let Err(e) = dirs.rename(victim, &temp, 0) {
        let removed = dirs.unlink(victim).is_ok();
        return Err((e, removed));
    }
    Ok(temp)
}

/// The rest of a claim, after `take_for_reuse` (outside any lock: a few
/// round trips on a network filesystem): opens, locks and trims the taken
/// file. On failure the temp file is removed.
pub fn open_taken(dirs: &HeldDirs, temp: std::path::PathBuf, file_len: usize, direct: bool) -> std::io::Result<PendingFile> {
    let claimed = dirs.open(&temp, libc::O_WRONLY | libc::O_NONBLOCK, 0).and_then(|fd| {
        let prepared = (|| {
            let st = fstat(fd)?;
            if regular_size(&st).is_none() {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            lock_if_current(dirs, fd, &st, &temp, libc::LOCK_EX)?;
            set_blocking(fd, direct)?;
            // A longer victim keeps no stale tail; a shorter one grows as it is written.
            let size = regular_file_size(fd)?.unwrap_or(0);
            // SAFETY: ftruncate takes no pointer; `fd` was opened above and is still open.
            if size > file_len as u64 && unsafe { libc::ftruncate(fd, file_len as libc::off_t) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(size.min(file_len as u64))
        })();
        match prepared {
            Ok(size) => Ok((fd, size)),
            Err(e) => {
                close(fd);
                Err(e)
            }
        }
    });
    match claimed {
        Ok((fd, size)) => Ok(PendingFile { fd, temp_path: Some(temp), size }),
        Err(e) => {
            let _ = dirs.unlink(&temp);
            Err(e)
        }
    }
}

fn cpath(path: &Path) -> std::io::Result<std::ffi::CString> {
    cstring(path).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

/// `.tmp-<pid>-<n>-w<owner>`: `owner` is the writer's lease id
/// (`disk::writers`), by which a scan tells a live writer's file from an orphan.
fn temp_name(dir: &Path, owner: u64) -> std::path::PathBuf {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    dir.join(format!("{TEMP_PREFIX}{}-{n}-w{owner:016x}", std::process::id()))
}

/// The writer's lease id in a temporary file's name (`temp_name`); None for
/// a name without one.
pub fn temp_owner(name: &str) -> Option<u64> {
    let (_, hex) = name.strip_prefix(TEMP_PREFIX)?.rsplit_once("-w")?;
    u64::from_str_radix(hex, 16).ok().filter(|_| hex.len() == 16)
}

/// A new temporary file in `dir` for `owner`'s put, locked (exclusively)
/// until published or discarded. The kernel drops the lock when the writer
/// dies, which is how a scan tells an orphan of a writer without a lease from
/// a live write; a scan never removes the file of a writer whose lease is live
/// (`remove_if_writer_gone`), so the moment between the create and the lock is
/// no race, and the put pays no look at its own file's name afterwards (two
/// round trips on a network filesystem).
pub fn open_for_write(
    dirs: &HeldDirs,
    dir: &Path,
    owner: u64,
    support: FsSupport,
    direct: bool,
    mode: u32,
) -> std::io::Result<PendingFile> {
    if support.tmpfile {
        let fd = open_raw(dir, libc::O_TMPFILE | libc::O_WRONLY | direct_flag(direct), mode)?;
        return Ok(PendingFile { fd, temp_path: None, size: 0 });
    }
    let temp = temp_name(dir, owner);
    let fd = dirs.open(&temp, libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | direct_flag(direct), mode)?;
    // Without flock here (some network filesystems) the file stays unlocked:
    // scans cannot judge it either and leave it to `STALE_TEMP_AGE`.
    // SAFETY: flock takes no pointer; `fd` was just opened.
    unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) };
    Ok(PendingFile { fd, temp_path: Some(temp), size: 0 })
}

/// Removes the temporary file `name` at `path` if it was left by a dead
/// writer: its owner (`temp_owner`) holds no live lease (`owner_live`), and
/// nobody holds its lock. Our own files are skipped (network filesystems
/// emulate flock with per-process locks, which we would always get). Returns
/// whether it was removed.
pub fn remove_if_writer_gone(path: &Path, name: &str, owner_live: &mut dyn FnMut(u64) -> bool) -> bool {
    if name.starts_with(&format!("{TEMP_PREFIX}{}-", std::process::id())) {
        return false;
    }
    if temp_owner(name).is_some_and(owner_live) {
        return false;
    }
    let Ok(fd) = open_raw(path, libc::O_RDONLY | libc::O_NONBLOCK, 0) else { return false };
    // SAFETY: flock takes no pointer; `fd` was opened above and is closed below.
    let unlocked = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0;
    let removed = unlocked && std::fs::remove_file(path).is_ok();
    close(fd);
    removed
}

/// Makes a completely written file visible under `final_path`.
/// Returns Ok(false) when another writer published the same chunk first: its
/// file stays (a named temp file of ours is removed), or, where the filesystem
/// cannot rename without replacing, ours replaced it (same content). Either
/// way the chunk's bytes on disk did not grow: the capacity ledger relies on it.
/// `noreplace`: the directory's filesystem takes `renameat2(RENAME_NOREPLACE)`
/// (`FsSupport::rename_noreplace`); without it the plain rename is the only try.
pub fn publish(dirs: &HeldDirs, file: &PendingFile, final_path: &Path, noreplace: bool) -> std::io::Result<bool> {
    if let Some(temp) = &file.temp_path {
        if noreplace {
            let Err(e) = dirs.rename(temp, final_path, libc::RENAME_NOREPLACE) else { return Ok(true) };
            match e.raw_os_error() {
                Some(libc::EEXIST) => {
                    let _ = dirs.unlink(temp);
                    return Ok(false);
                }
                // Refused after all (another filesystem mounted over the probed
                // directory): the plain rename below.
                Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => {}
                _ => return Err(e),
            }
        }
        // No RENAME_NOREPLACE here (some FUSE and network filesystems): a
        // plain rename, which replaces an existing chunk of the same key.
        let existed = dirs.lstat_once(final_path).is_ok();
        dirs.rename(temp, final_path, 0)?;
        return Ok(!existed);
    }
    let dst = cstring(final_path).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // linkat through /proc avoids needing CAP_DAC_READ_SEARCH for AT_EMPTY_PATH.
    let src = std::ffi::CString::new(format!("/proc/self/fd/{}", file.fd)).unwrap();
    // SAFETY: both are NUL-terminated paths that live across the call.
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

/// Allocates the whole file before it is written. On ext4 a direct write
/// past the end of a file is an extending write (exclusive inode lock, size
/// update and orphan handling in the journal at completion); into allocated
/// space it is not. Measured: fresh-file writes 0.65x -> 0.82x of fio's best.
pub fn preallocate(fd: RawFd, len: usize) -> std::io::Result<()> {
    loop {
        // SAFETY: fallocate takes no pointer; `fd` is the caller's open descriptor.
        if unsafe { libc::fallocate(fd, 0, 0, len as libc::off_t) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

pub fn discard(dirs: &HeldDirs, file: &PendingFile) {
    if let Some(temp) = &file.temp_path {
        let _ = dirs.unlink(temp);
    }
    close(file.fd);
}

pub fn close(fd: RawFd) {
    // SAFETY: the caller owns `fd` and gives it up here: every descriptor is closed once, by the
    // operation or function that opened it, so no other owner's descriptor of that number is
    // closed.
    unsafe { libc::close(fd) };
}

/// Size of a regular file; None for anything else (FIFO, device, ...).
pub fn regular_file_size(fd: RawFd) -> std::io::Result<Option<u64>> {
    Ok(regular_size(&fstat(fd)?))
}

fn regular_size(st: &libc::stat) -> Option<u64> {
    (st.st_mode & libc::S_IFMT == libc::S_IFREG).then_some(st.st_size as u64)
}

/// One `fstat` (on a network filesystem without attribute caching, a round trip).
fn fstat(fd: RawFd) -> std::io::Result<libc::stat> {
    // SAFETY: stat is plain data, for which all-zero bytes are a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a writable stat that lives across the call; `fd` is the caller's open
    // descriptor.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// After buffered I/O, keep the page cache from filling with chunk data
/// (the staging pool is the cache; double caching only evicts useful pages).
pub fn drop_cached_pages(fd: RawFd, written: bool) {
    // SAFETY: neither call takes a pointer; `fd` is the caller's open descriptor.
    unsafe {
        if written {
            libc::sync_file_range(
                fd,
                0,
                0,
                libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER,
            );
        }
        libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// One direct-I/O block: O_DIRECT transfers need memory aligned like the file offsets.
#[repr(C, align(4096))]
struct AlignedBlock([u8; IO_ALIGN]);
const _: () = assert!(std::mem::align_of::<AlignedBlock>() == IO_ALIGN);

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
    let (fallocate, punch_hole) = match open_raw(&probe_path, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, mode) {
        Ok(fd) => {
            let ok = preallocate(fd, IO_ALIGN).is_ok();
            let punched = punches_holes(fd);
            close(fd);
            let _ = std::fs::remove_file(&probe_path);
            (ok, punched)
        }
        Err(_) => (false, false),
    };
    let direct = match open_raw(&probe_path, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_DIRECT, mode) {
        Ok(fd) => {
            let mut block = Box::new(AlignedBlock([0; IO_ALIGN]));
            let buf = block.0.as_mut_ptr();
            // SAFETY: `buf` is the IO_ALIGN bytes of `block`, IO_ALIGN-aligned as O_DIRECT
            // needs, alive across both calls; pwrite reads them, pread writes at most them.
            let (n, m) = unsafe { (libc::pwrite(fd, buf as *const _, IO_ALIGN, 0), libc::pread(fd, buf as *mut _, IO_ALIGN, 0)) };
            close(fd);
            n == IO_ALIGN as isize && m == IO_ALIGN as isize
        }
        Err(_) => false,
    };
    let (mut direct_unaligned, mut direct_set_after_open) = (false, false);
    if let Ok(fd) = open_raw(&probe_path, libc::O_CREAT | libc::O_RDWR | libc::O_DIRECT, mode) {
        // 512 bytes from an odd address at an odd offset: refused (EINVAL)
        // wherever O_DIRECT really bypasses the page cache.
        let buf = [0u8; 1024];
        // SAFETY: `buf` is 1024 bytes, so the 512 from its second byte lie inside it; pwrite only
        // reads them.
        direct_unaligned = unsafe { libc::pwrite(fd, buf.as_ptr().add(1) as *const _, 512, 3) } == 512;
        close(fd);
    }
    if let Ok(fd) = open_raw(&probe_path, libc::O_CREAT | libc::O_RDWR, mode) {
        // SAFETY: fcntl's F_GETFL and F_SETFL take no pointer; `fd` was opened just above.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags >= 0 && unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT) } == 0 {
            // SAFETY: as above.
            direct_set_after_open = unsafe { libc::fcntl(fd, libc::F_GETFL) } & libc::O_DIRECT != 0;
        }
        close(fd);
    }
    let rename_noreplace = probe_rename_noreplace(&probe_path, mode);
    let _ = std::fs::remove_file(&probe_path);
    FsSupport { direct, tmpfile, fallocate, direct_unaligned, direct_set_after_open, rename_noreplace, punch_hole }
}

/// Whether a hole punched in `fd` (a fresh file) reads back as zeros:
/// written, punched, read. A filesystem that accepts the call and keeps the
/// bytes (a FUSE daemon that allocates whatever the mode) does not count.
fn punches_holes(fd: RawFd) -> bool {
    let mut block = [0x5au8; IO_ALIGN];
    // SAFETY: `block` is IO_ALIGN bytes alive across the call; pwrite only reads them.
    if unsafe { libc::pwrite(fd, block.as_ptr() as *const _, IO_ALIGN, 0) } != IO_ALIGN as isize {
        return false;
    }
    // SAFETY: fallocate takes no pointer; `fd` is open for the call.
    if unsafe { libc::fallocate(fd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, IO_ALIGN as libc::off_t) } != 0 {
        return false;
    }
    // SAFETY: `block` is IO_ALIGN writable bytes alive across the call; pread writes at most that.
    let n = unsafe { libc::pread(fd, block.as_mut_ptr() as *mut _, IO_ALIGN, 0) };
    n == IO_ALIGN as isize && block.iter().all(|&b| b == 0)
}

/// Whether `renameat2(RENAME_NOREPLACE)` of a fresh file to a free name
/// works in `probe_path`'s directory. Any other error than the three that
/// say "not supported here" counts as supported: publish then asks, and
/// falls back as before if it is refused after all.
fn probe_rename_noreplace(probe_path: &Path, mode: u32) -> bool {
    let target = probe_path.with_extension("renamed");
    let Ok(fd) = open_raw(probe_path, libc::O_CREAT | libc::O_RDWR, mode) else { return true };
    close(fd);
    let (Ok(src), Ok(dst)) = (cstring(probe_path), cstring(&target)) else { return true };
    // SAFETY: both are NUL-terminated paths that live across the call.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, src.as_ptr(), libc::AT_FDCWD, dst.as_ptr(), libc::RENAME_NOREPLACE) };
    let refused = rc != 0 && matches!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP));
    let _ = std::fs::remove_file(&target);
    !refused
}

/// The circuit breaker's probe of a directory: statvfs, then a 4 KiB file
/// created, written, read back and unlinked. Any error says the directory
/// is not usable yet.
pub fn probe_health(dir: &Path) -> std::io::Result<()> {
    fs_space(dir)?;
    let path = dir.join(format!("{TEMP_PREFIX}health-{}-{}", std::process::id(), TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)));
    let fd = open_raw(&path, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600)?;
    let buf = [0x5au8; IO_ALIGN];
    let mut back = [0u8; IO_ALIGN];
    let result = (|| {
        // SAFETY: `buf` is IO_ALIGN bytes that live across the call; pwrite only reads them.
        if unsafe { libc::pwrite(fd, buf.as_ptr() as *const _, IO_ALIGN, 0) } != IO_ALIGN as isize {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `back` is IO_ALIGN writable bytes that live across the call; pread writes at most
        // that.
        if unsafe { libc::pread(fd, back.as_mut_ptr() as *mut _, IO_ALIGN, 0) } != IO_ALIGN as isize || back != buf {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    })();
    close(fd);
    let unlinked = std::fs::remove_file(&path);
    result.and(unlinked)
}

/// Marks a filler chunk file (see `BlockStore::mark_filler`). O_NOFOLLOW: a
/// symlink planted at a chunk path is never followed.
pub fn set_mtime_to_epoch(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
    f.set_modified(std::time::SystemTime::UNIX_EPOCH)
}

/// Size and space of the filesystem holding `dir`, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsSpace {
    pub total: u64,
    /// Free to this (unprivileged) process: `f_bavail`, not `f_bfree`.
    pub available: u64,
    /// Identifies the filesystem (`f_fsid`): several roots on one count once.
    pub fsid: u64,
}

/// One `statvfs`: cheap enough (~1 µs) to call once per put.
pub fn fs_space(dir: &Path) -> std::io::Result<FsSpace> {
    let c = cpath(dir)?;
    // SAFETY: statvfs is plain data, for which all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` a writable statvfs; both live across the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(space_of(&st))
}

/// `fs_space` from `dir`'s held descriptor: no walk of its path.
pub fn fs_space_held(dirs: &HeldDirs, dir: &Path) -> std::io::Result<FsSpace> {
    Ok(space_of(&dirs.statvfs(dir)?))
}

fn space_of(st: &libc::statvfs) -> FsSpace {
    let frsize = st.f_frsize;
    FsSpace { total: st.f_blocks.saturating_mul(frsize), available: st.f_bavail.saturating_mul(frsize), fsid: st.f_fsid }
}
