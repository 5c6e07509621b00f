//! What a store is opened with: the configuration, its defaults (the one
//! place they are defined; Python reads them as `_core.ENGINE_DEFAULTS`) and
//! the accepted choices of each option.

use std::path::PathBuf;

use crate::disk::files::DirectIoPolicy;
use crate::disk::layout::Permissions;
use crate::error::{parse_choice, Result};
use crate::faults::SharedFaults;

/// Defaults of the options a caller may leave out. `StoreConfig::new` and the
/// Python binding's keyword defaults both read these.
pub mod defaults {
    pub const QUEUE_DEPTH: usize = 32;
    pub const MAX_INFLIGHT: usize = 1024;
    pub const SEGMENT_BYTES: usize = 4 << 20;
    /// 0 = each chunk written in one transfer.
    pub const WRITE_SEGMENT_BYTES: usize = 0;
    /// 0 = chosen from the queue depth.
    pub const IO_THREADS: usize = 0;
    pub const CHUNK_WORKERS: usize = 2;
    /// Seconds a put/get waits for a free operation entry (Python `submit_timeout`).
    pub const SUBMIT_TIMEOUT_S: f64 = 30.0;
    pub const BACKEND: &str = "auto";
    pub const DIRECT_IO: &str = "optional";
    pub const VERIFY: &str = "full";
    /// Walk while another writer's lease is live (exported as "auto").
    pub const REFRESH_INTERVAL_S: super::RefreshPolicy = super::RefreshPolicy::Auto;
    pub use crate::disk::layout::{DEFAULT_DIR_MODE as DIR_MODE, DEFAULT_FILE_MODE as FILE_MODE};
}

pub const MAX_INFLIGHT: usize = 1 << 16;
/// Bound on `io_threads` and `chunk_workers`.
pub const MAX_THREADS: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    IoUring,
    Threads,
}

/// How much of a chunk is checksummed: verified by reads, computed by writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyPolicy {
    /// Header (magic, version, namespace, key, length, header CRC) and payload CRC.
    Full,
    /// Header only: for filesystems/devices that checksum data themselves
    /// (ZFS, btrfs, dm-integrity) when the payload pass costs too much CPU.
    /// Writes then compute no payload CRC either (flagged in the header): a
    /// `Full` reader sharing the directory treats such chunks as misses.
    Header,
}

impl VerifyPolicy {
    /// The accepted names, in the order of the variants (`_core.VERIFY_MODES`).
    pub const CHOICES: [&'static str; 2] = ["full", "header"];
    const ALL: [Self; 2] = [Self::Full, Self::Header];

    pub fn parse(s: &str) -> Result<Self> {
        parse_choice("verify", s, &Self::CHOICES, &Self::ALL)
    }
}

impl BackendChoice {
    /// The accepted names, in the order of the variants (`_core.BACKENDS`).
    pub const CHOICES: [&'static str; 3] = ["auto", "io_uring", "threads"];
    const ALL: [Self; 3] = [Self::Auto, Self::IoUring, Self::Threads];

    pub fn parse(s: &str) -> Result<Self> {
        parse_choice("backend", s, &Self::CHOICES, &Self::ALL)
    }
}

pub struct StoreConfig {
    pub dirs: Vec<PathBuf>,
    pub namespace: String,
    pub capacity_bytes: u64,
    pub queue_depth: usize,
    pub backend: BackendChoice,
    pub direct_io: DirectIoPolicy,
    pub register_buffers: bool,
    pub segment_bytes: usize,
    /// Segment size of writes; 0 = the whole chunk in one transfer (measured
    /// faster on ext4: one direct write per file instead of several that
    /// contend for the inode; reads still gain from parallel segments).
    pub write_segment_bytes: usize,
    pub max_inflight: usize,
    pub io_threads: usize,
    /// Threads that checksum, verify and publish chunks.
    pub chunk_workers: usize,
    pub verify: VerifyPolicy,
    /// Overwrite the chunk file a write evicts instead of unlinking it and
    /// allocating a fresh one (see `files::claim_for_reuse`).
    pub recycle_files: bool,
    /// Rebuild the index in a background thread instead of before `open`
    /// returns (see `scan`): for stores of very many chunks.
    pub background_scan: bool,
    /// Allocate each chunk file (fallocate) before writing it (see `files::preallocate`).
    pub preallocate: bool,
    pub permissions: Permissions,
    /// Space kept free on each storage filesystem for other writers.
    pub min_free: FreeSpaceReserve,
    /// How long a get or put may take before it is abandoned (a miss, a
    /// skipped put); None: `health::default_deadline` of the slot size.
    pub io_deadline: Option<std::time::Duration>,
    /// When to walk the directories and bring the index in line with them
    /// (`BlockStore::refresh`), for directories other processes or nodes
    /// write too, so that the capacity bounds what all of them store (their
    /// chunks count and are evicted here). Default `Auto`.
    pub refresh: RefreshPolicy,
    pub faults: SharedFaults,
}

/// When a store walks its directories for what other writers did
/// (decision 0053).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefreshPolicy {
    /// Only at open and `rescan`/`refresh` calls.
    Off,
    /// Every this often, whoever else writes.
    Every(std::time::Duration),
    /// While another writer holds a lease in a root (`disk::writers`, checked
    /// every `WRITER_CHECK`): at once when one appears or leaves, then every
    /// `AUTO_REFRESH_COST` times the last walk's duration, within
    /// [`AUTO_REFRESH_MIN`, `AUTO_REFRESH_MAX`]. Alone, no walk at all.
    Auto,
}

/// How often a store in `RefreshPolicy::Auto` looks for other writers' leases
/// (a `readdir` of a few entries and one `flock` probe each).
pub const WRITER_CHECK: std::time::Duration = std::time::Duration::from_secs(1);
/// Walks in `Auto` take at most 1/this of a core: a walk of 100k chunks on a
/// local disk takes ~0.76 s warm (decision 0017), a small store's milliseconds.
pub const AUTO_REFRESH_COST: u32 = 20;
pub const AUTO_REFRESH_MIN: std::time::Duration = std::time::Duration::from_secs(1);
pub const AUTO_REFRESH_MAX: std::time::Duration = std::time::Duration::from_secs(10);

/// How much of each storage filesystem eviction keeps free for other writers
/// (logs, downloads, a second store): a put first evicts until its bytes fit
/// *and* this much stays free, and is refused when even an empty store could
/// not keep it. Checked with one `statvfs` per put.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FreeSpaceReserve {
    /// `DEFAULT_RESERVE_FRACTION` of the filesystem, at most `DEFAULT_RESERVE_MAX` bytes.
    Default,
    /// At least these many bytes, and at least this fraction of the filesystem.
    AtLeast { bytes: u64, fraction: f64 },
}

pub const DEFAULT_RESERVE_FRACTION: f64 = 0.05;
pub const DEFAULT_RESERVE_MAX: u64 = 16 << 30;

impl FreeSpaceReserve {
    /// The reserve in bytes on a filesystem of `total` bytes.
    pub fn bytes_for(self, total: u64) -> u64 {
        match self {
            Self::Default => ((total as f64 * DEFAULT_RESERVE_FRACTION) as u64).min(DEFAULT_RESERVE_MAX),
            Self::AtLeast { bytes, fraction } => bytes.max((total as f64 * fraction) as u64),
        }
    }
}

impl StoreConfig {
    pub fn new(dirs: Vec<PathBuf>, namespace: impl Into<String>, capacity_bytes: u64) -> Self {
        StoreConfig {
            dirs,
            namespace: namespace.into(),
            capacity_bytes,
            queue_depth: defaults::QUEUE_DEPTH,
            backend: BackendChoice::Auto,
            direct_io: DirectIoPolicy::Optional,
            register_buffers: true,
            segment_bytes: defaults::SEGMENT_BYTES,
            write_segment_bytes: defaults::WRITE_SEGMENT_BYTES,
            max_inflight: defaults::MAX_INFLIGHT,
            io_threads: defaults::IO_THREADS,
            chunk_workers: defaults::CHUNK_WORKERS,
            verify: VerifyPolicy::Full,
            recycle_files: true,
            background_scan: false,
            preallocate: true,
            permissions: Permissions::default(),
            min_free: FreeSpaceReserve::Default,
            io_deadline: None,
            refresh: RefreshPolicy::Auto,
            faults: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_as_their_choices() {
        assert_eq!(BackendChoice::parse(defaults::BACKEND).unwrap(), BackendChoice::Auto);
        assert_eq!(VerifyPolicy::parse(defaults::VERIFY).unwrap(), VerifyPolicy::Full);
        assert_eq!(DirectIoPolicy::parse(defaults::DIRECT_IO).unwrap(), DirectIoPolicy::Optional);
        let err = BackendChoice::parse("spdk").unwrap_err().to_string();
        assert!(err.contains("backend must be auto|io_uring|threads, not \"spdk\""), "{err}");
        let p = Permissions::default();
        assert_eq!((p.dir_mode, p.file_mode), (defaults::DIR_MODE, defaults::FILE_MODE));
    }

    #[test]
    fn free_space_reserve_in_bytes() {
        let tb = 1u64 << 40;
        assert_eq!(FreeSpaceReserve::Default.bytes_for(100 << 30), 5 << 30, "5% of a 100 GiB filesystem");
        assert_eq!(FreeSpaceReserve::Default.bytes_for(4 * tb), DEFAULT_RESERVE_MAX, "capped on large filesystems");
        let r = FreeSpaceReserve::AtLeast { bytes: 1 << 30, fraction: 0.1 };
        assert_eq!(r.bytes_for(100 << 30), 10 << 30, "the larger of the two");
        assert_eq!(r.bytes_for(4 << 30), 1 << 30);
        assert_eq!(FreeSpaceReserve::AtLeast { bytes: 0, fraction: 0.0 }.bytes_for(tb), 0, "off");
    }
}
