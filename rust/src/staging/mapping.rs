//! Reserving and mapping a pool's region: 2 MiB aligned address space, then
//! anonymous memory, a named shared-memory file or a memfd in it (reserved
//! in full up front: a SIGBUS later is worse than an error now), and finding
//! another process's memfd by its label.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use super::MAP_ALIGN;
use crate::disk::format::round_up;
use crate::error::{EngineError, Result};

pub(super) fn check_shm_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        && !name.starts_with('.');
    if !ok {
        return Err(EngineError::invalid(format!("invalid shared-memory name {name:?} (use [A-Za-z0-9_.-])")));
    }
    Ok(())
}

pub(super) fn shm_path(name: &str) -> Result<String> {
    check_shm_name(name)?;
    Ok(format!("/dev/shm/{name}"))
}

/// Reserves address space with room to align the mapping to 2 MiB.
pub(super) fn reserve_aligned(len: usize) -> Result<(*mut u8, usize, *mut u8)> {
    // `len` may come from a file's size (attach): checked, never wrapped.
    let reserved_len = len.checked_add(MAP_ALIGN).ok_or_else(|| EngineError::invalid("staging pool too large for the address space"))?;
    // SAFETY: a new PROT_NONE anonymous mapping where the kernel chooses: no existing memory is
    // affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserved_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(EngineError::last_os("reserving staging address space"));
    }
    let base = round_up(p as usize, MAP_ALIGN) as *mut u8;
    Ok((p as *mut u8, reserved_len, base))
}

pub(super) fn map_anonymous(base: *mut u8, len: usize) -> Result<()> {
    // SAFETY: MAP_FIXED replaces `[base, base + len)`, which lies inside the PROT_NONE reservation
    // `reserve_aligned(len)` made for this pool (its base rounded up by less than the MAP_ALIGN
    // extra it reserved): no other memory is unmapped.
    let p = unsafe {
        libc::mmap(
            base as *mut _,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(EngineError::last_os("mapping staging memory"));
    }
    // SAFETY: advice on the range just mapped; it changes no contents.
    unsafe { libc::madvise(base as *mut _, len, libc::MADV_HUGEPAGE) };
    Ok(())
}

/// Creates `/dev/shm/<name>` exclusively, reserves `len` bytes and maps it at `base`.
pub(super) fn map_shm(base: *mut u8, len: usize, name: &str) -> Result<()> {
    let path = shm_path(name)?;
    let cpath = CString::new(path.clone()).unwrap();
    // SAFETY: `cpath` is a NUL-terminated path that lives across the call.
    let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_CREAT | libc::O_EXCL, 0o600) };
    if fd < 0 {
        return Err(EngineError::last_os(format!("creating shared staging {path}")));
    }
    // SAFETY: `fd` was just opened (non-negative) and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let result = size_and_reserve(fd.as_raw_fd(), len, &path).and_then(|()| map_fd(base, len, fd.as_raw_fd(), &path));
    if result.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    result
}

/// Creates a memfd labelled `name`, reserves `len` bytes and maps it at `base`.
pub(super) fn map_memfd(base: *mut u8, len: usize, name: &str) -> Result<OwnedFd> {
    check_shm_name(name)?;
    let cname = CString::new(name).unwrap();
    // SAFETY: `cname` is NUL-terminated and lives across the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(EngineError::last_os(format!("creating shared staging memfd {name}")));
    }
    // SAFETY: `fd` was just created (non-negative) and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let what = format!("memfd {name}");
    size_and_reserve(fd.as_raw_fd(), len, &what)?;
    map_fd(base, len, fd.as_raw_fd(), &what)?;
    Ok(fd)
}

/// Sizes a fresh shared-memory file and allocates every page of it now. A
/// tmpfs file is sparse: without this, a region larger than the free space of
/// its filesystem (Docker's `--shm-size`) or than free memory is created fine
/// and its owner dies of SIGBUS when a slot is first touched, possibly hours later.
fn size_and_reserve(fd: libc::c_int, len: usize, what: &str) -> Result<()> {
    // SAFETY: ftruncate takes no pointer; `fd` is the caller's open descriptor.
    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
        return Err(EngineError::last_os(format!("sizing shared staging {what}")));
    }
    // Allocating shared memory past what is free does not fail: it wakes the
    // OOM killer, which may pick any process. Refuse first.
    if available_memory().is_some_and(|avail| len > avail) {
        return Err(EngineError::io(reserve_failure(len, what), std::io::Error::from_raw_os_error(libc::ENOMEM)));
    }
    loop {
        // Returns the error number instead of setting errno.
        // SAFETY: posix_fallocate takes no pointer; `fd` is the caller's open descriptor.
        let rc = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        match rc {
            0 => return Ok(()),
            libc::EINTR => continue, // pages allocated so far stay; resume
            _ => return Err(EngineError::io(reserve_failure(len, what), std::io::Error::from_raw_os_error(rc))),
        }
    }
}

/// The context of a failed reservation: what was asked, what was free, the fix.
fn reserve_failure(len: usize, what: &str) -> String {
    let avail = available_memory();
    let need = fmt_bytes(len);
    match avail {
        Some(avail) if len > avail => format!(
            "cannot reserve {need} of shared staging memory for {what}: only {} of memory available \
             (use a smaller staging pool)",
            fmt_bytes(avail)
        ),
        _ if what.starts_with("/dev/shm/") => format!(
            "cannot reserve {need} of shared staging memory for {what}: {} free on /dev/shm \
             (give it more room with docker run --shm-size=<size> or --ipc=host, or use a smaller staging pool)",
            shm_free_bytes().map_or("unknown".to_owned(), fmt_bytes)
        ),
        _ => format!(
            "cannot reserve {need} of shared staging memory for {what}: {} of memory available \
             (use a smaller staging pool)",
            avail.map_or("unknown".to_owned(), fmt_bytes)
        ),
    }
}

fn shm_free_bytes() -> Option<usize> {
    // SAFETY: statvfs is plain data, for which all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let path = CString::new("/dev/shm").unwrap();
    // SAFETY: `path` is NUL-terminated and `st` a writable statvfs; both live across the call.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as usize).saturating_mul(st.f_frsize as usize))
}

/// Memory this process can still get: the system's MemAvailable, lowered to
/// what its cgroup (v2) limit leaves, as in a container with `--memory`.
fn available_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    let mut avail = kib.saturating_mul(1024);
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    if let Some(path) = cgroup.lines().find_map(|l| l.strip_prefix("0::")) {
        let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup{path}/{f}")).ok();
        let max = read("memory.max").and_then(|t| t.trim().parse::<usize>().ok()); // "max": no limit
        let current = read("memory.current").and_then(|t| t.trim().parse::<usize>().ok());
        if let (Some(max), Some(current)) = (max, current) {
            // Page cache (e.g. of the model weights just read) is reclaimed on
            // demand; tmpfs/shared memory in "file" is not.
            let stat = read("memory.stat").unwrap_or_default();
            let field =
                |k: &str| stat.lines().find_map(|l| l.strip_prefix(k)?.strip_prefix(' ')?.trim().parse::<usize>().ok()).unwrap_or(0);
            let reclaimable = field("file").saturating_sub(field("shmem"));
            avail = avail.min(max.saturating_sub(current.saturating_sub(reclaimable)));
        }
    }
    Some(avail)
}

fn fmt_bytes(n: usize) -> String {
    format!("{:.1} MiB ({n} bytes)", n as f64 / (1u64 << 20) as f64)
}

pub(super) fn map_fd(base: *mut u8, len: usize, fd: libc::c_int, what: &str) -> Result<()> {
    // SAFETY: as in `map_anonymous`: `[base, base + len)` lies inside the reservation
    // `reserve_aligned(len)` made for this pool, which MAP_FIXED replaces; no other memory is
    // unmapped.
    let p = unsafe { libc::mmap(base as *mut _, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(EngineError::last_os(format!("mapping shared staging {what}")));
    }
    Ok(())
}

/// `/proc/<pid>/fd/<n>` of the memfd labelled `name`. Its owner keeps it open
/// for the pool's life; attachers close theirs once mapped, so several hits in
/// other processes are the same region only if they are the same inode.
pub(super) fn find_memfd(name: &str) -> Result<String> {
    let target = format!("/memfd:{name} (deleted)");
    let me = std::process::id();
    // SAFETY: getppid takes no argument and cannot fail.
    let parent = unsafe { libc::getppid() } as u32;
    for pid in [me, parent] {
        if let Some(path) = memfd_in(pid, &target) {
            return Ok(path);
        }
    }
    let mut found: Vec<(String, (u64, u64))> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            if pid == me || pid == parent {
                continue;
            }
            if let Some(path) = memfd_in(pid, &target) {
                if let Ok(meta) = std::fs::metadata(&path) {
                    let id = (meta.dev(), meta.ino());
                    if !found.iter().any(|(_, other)| *other == id) {
                        found.push((path, id));
                    }
                }
            }
        }
    }
    match found.len() {
        1 => Ok(found.pop().unwrap().0),
        0 => Err(EngineError::io(
            format!("no process holds a staging memfd named {name} (its owner exited, or runs in another PID namespace)"),
            std::io::Error::from_raw_os_error(libc::ENOENT),
        )),
        n => Err(EngineError::State(format!("{n} processes hold a staging memfd named {name}: give each engine its own name"))),
    }
}

fn memfd_in(pid: u32, target: &str) -> Option<String> {
    let dir = format!("/proc/{pid}/fd");
    for entry in std::fs::read_dir(&dir).ok()?.flatten() {
        if std::fs::read_link(entry.path()).is_ok_and(|link| link.as_os_str() == target) {
            return Some(entry.path().to_string_lossy().into_owned());
        }
    }
    None
}
