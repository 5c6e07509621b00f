//! What a store is opened with: the configuration, its defaults and limits
//! (the one place they are defined; Python reads them as
//! `_core.ENGINE_DEFAULTS` and `_core.ENGINE_LIMITS`), the accepted choices
//! of each option, and `StoreConfig::validate`, the one check of them all.

use std::path::PathBuf;
use std::time::Duration;

use crate::disk::files::DirectIoPolicy;
use crate::disk::format::{self, IO_ALIGN};
use crate::disk::layout::Permissions;
use crate::error::{parse_choice, EngineError, Result};
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
    /// Seal buffers of a store with an encryption key: sealed puts in flight at once.
    pub const SEAL_BUFFERS: usize = 2;
    /// Seconds a put/get waits for a free operation entry (Python `submit_timeout`).
    pub const SUBMIT_TIMEOUT_S: f64 = 30.0;
    pub const BACKEND: &str = "auto";
    pub const DIRECT_IO: &str = "optional";
    /// Segment files where every root is on a network filesystem that punches holes (exported as "auto").
    pub const SEGMENT_FILES: super::SegmentFiles = super::SegmentFiles::Auto;
    pub const VERIFY: &str = "full";
    /// Walk while another writer's lease is live (exported as "auto").
    pub const REFRESH_INTERVAL_S: super::RefreshPolicy = super::RefreshPolicy::Auto;
    pub use crate::disk::layout::{DEFAULT_DIR_MODE as DIR_MODE, DEFAULT_FILE_MODE as FILE_MODE};
}

/// Inclusive bounds of the counts a caller gives (`_core.ENGINE_LIMITS`):
/// they become queue, table and thread sizes, so a typo is an error and not
/// an allocation failure (abort) or a thread storm.
pub mod limits {
    /// io_uring submission queue depth.
    pub const QUEUE_DEPTH: (usize, usize) = crate::backend::uring::DEPTH_LIMITS;
    /// Operation table entries, allocated up front.
    pub const MAX_INFLIGHT: (usize, usize) = (1, 1 << 16);
    /// 0 = chosen from the queue depth.
    pub const IO_THREADS: (usize, usize) = (0, 1024);
    /// 0 = one.
    pub const CHUNK_WORKERS: (usize, usize) = (0, 1024);
    /// Seal buffers, each the size of a slot's file, allocated at open.
    pub const SEAL_BUFFERS: (usize, usize) = (1, 1024);
    /// Staging slots of one pool (slot numbers are 16-bit).
    pub const NUM_SLOTS: (usize, usize) = (1, crate::staging::MAX_SLOTS);
    /// Timeouts longer than this many seconds (about 31.7 years, `inf`
    /// included) mean "wait forever": `Duration::from_secs_f64` panics past
    /// its range and `Instant + Duration` past the clock's, so huge values
    /// never reach them.
    pub const FOREVER_S: f64 = 1e9;
}

/// How long a get or put may take on a stalled directory before it is
/// abandoned (a miss, a skipped put).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoDeadline {
    /// `default_deadline` of the slot size.
    Default,
    After(Duration),
    /// Never abandoned (a timeout above `limits::FOREVER_S`, as everywhere).
    Never,
}

/// The default deadline: `max(DEADLINE_FLOOR, DEADLINE_FACTOR * chunk_bytes /
/// ASSUMED_BANDWIDTH)`. The bandwidth is assumed, not measured: a slow
/// network filesystem (the two-node GlusterFS fixture moved 0.29-0.38 GB/s).
pub const DEADLINE_FLOOR: Duration = Duration::from_secs(2);
pub const DEADLINE_FACTOR: f64 = 4.0;
pub const ASSUMED_BANDWIDTH: f64 = 100e6;

pub fn default_deadline(chunk_bytes: usize) -> Duration {
    let secs = DEADLINE_FACTOR * chunk_bytes as f64 / ASSUMED_BANDWIDTH;
    DEADLINE_FLOOR.max(Duration::from_secs_f64(secs))
}

/// The deadline a store runs with for `IoDeadline::Never`: a bound no
/// operation reaches (`Health` keeps its breaker's back-off finite).
pub const NO_DEADLINE: Duration = Duration::from_secs(limits::FOREVER_S as u64);

impl IoDeadline {
    /// The deadline for slots of `stride` bytes.
    pub fn resolve(self, stride: usize) -> Duration {
        match self {
            Self::Default => default_deadline(stride),
            Self::After(d) => d,
            Self::Never => NO_DEADLINE,
        }
    }
}

fn check_range(name: &str, value: usize, (lo, hi): (usize, usize), note: &str) -> Result<()> {
    if (lo..=hi).contains(&value) {
        return Ok(());
    }
    Err(EngineError::invalid(format!("{name} must be in {lo}..={hi}{note}, got {value}")))
}

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

/// Where a store writes new chunks (decision 0086).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentFiles {
    /// One file per chunk.
    Off,
    /// Slots of segment files.
    On,
    /// Segment files where every root is on a network or FUSE filesystem
    /// that punches holes (an evicted slot's bytes are freed); else files.
    Auto,
}

impl SegmentFiles {
    /// Whether a store on `roots`, whose filesystems punch holes as
    /// `punches` says, writes segment files.
    pub fn resolve(self, roots: &[PathBuf], punches: &[bool]) -> bool {
        match self {
            SegmentFiles::Off => false,
            SegmentFiles::On => true,
            SegmentFiles::Auto => !roots.is_empty() && roots.iter().zip(punches).all(|(r, p)| *p && crate::disk::roots::on_network_fs(r)),
        }
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
    /// allocating a fresh one (see `files::take_for_reuse`).
    pub recycle_files: bool,
    /// Rebuild the index in a background thread instead of before `open`
    /// returns (see `scan`): for stores of very many chunks.
    pub background_scan: bool,
    /// Allocate each chunk file (fallocate) before writing it (see `files::preallocate`).
    pub preallocate: bool,
    /// Whether new chunks go into slots of segment files published by their
    /// index (decision 0086, `disk::segment`) instead of one file each; both
    /// are always read. For network filesystems, where every name is a round trip.
    pub segment_files: SegmentFiles,
    pub permissions: Permissions,
    /// Space kept free on each storage filesystem for other writers.
    pub min_free: FreeSpaceReserve,
    /// How long a get or put may take before it is abandoned (a miss, a
    /// skipped put).
    pub io_deadline: IoDeadline,
    /// When to walk the directories and bring the index in line with them
    /// (`BlockStore::refresh`), for directories other processes or nodes
    /// write too, so that the capacity bounds what all of them store (their
    /// chunks count and are evicted here). Default `Auto`.
    pub refresh: RefreshPolicy,
    /// Seal every chunk written with this key file, and read only sealed
    /// chunks (decision 0083). None: plaintext chunks, as before.
    pub encryption_key_file: Option<PathBuf>,
    /// The key file `encryption_key_file` replaced: chunks sealed with it stay
    /// readable; nothing is sealed with it.
    pub encryption_previous_key_file: Option<PathBuf>,
    /// Seal buffers (with a key): each holds one put from submission to completion.
    pub seal_buffers: usize,
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
            segment_files: defaults::SEGMENT_FILES,
            permissions: Permissions::default(),
            min_free: FreeSpaceReserve::Default,
            io_deadline: IoDeadline::Default,
            refresh: RefreshPolicy::Auto,
            encryption_key_file: None,
            encryption_previous_key_file: None,
            seal_buffers: defaults::SEAL_BUFFERS,
            faults: None,
        }
    }
}

impl StoreConfig {
    /// Every check of the configuration that needs no directory: what
    /// `BlockStore::open` refuses before it touches anything, for slots of
    /// `stride` bytes. The bindings convert types only and leave the rest here.
    pub fn validate(&self, stride: usize) -> Result<()> {
        if self.segment_bytes < IO_ALIGN || !self.segment_bytes.is_multiple_of(IO_ALIGN) {
            return Err(EngineError::invalid(format!(
                "segment_bytes must be a positive multiple of {IO_ALIGN}, got {}",
                self.segment_bytes
            )));
        }
        if !self.write_segment_bytes.is_multiple_of(IO_ALIGN) {
            return Err(EngineError::invalid(format!(
                "write_segment_bytes must be 0 (whole chunk) or a multiple of {IO_ALIGN}, got {}",
                self.write_segment_bytes
            )));
        }
        check_range("queue_depth", self.queue_depth, limits::QUEUE_DEPTH, "")?;
        check_range("max_inflight", self.max_inflight, limits::MAX_INFLIGHT, "")?;
        check_range("io_threads", self.io_threads, limits::IO_THREADS, " (0 = auto)")?;
        check_range("chunk_workers", self.chunk_workers, limits::CHUNK_WORKERS, "")?;
        check_range("seal_buffers", self.seal_buffers, limits::SEAL_BUFFERS, "")?;
        if self.encryption_previous_key_file.is_some() && self.encryption_key_file.is_none() {
            return Err(EngineError::invalid(
                "encryption_previous_key_file needs encryption_key_file (the key new chunks are sealed with)",
            ));
        }
        // Segments of one operation are counted in a u32.
        let smallest = self.segment_bytes.min(if self.write_segment_bytes == 0 { usize::MAX } else { self.write_segment_bytes });
        if stride / smallest >= u32::MAX as usize {
            return Err(EngineError::invalid(format!(
                "segment_bytes/write_segment_bytes of {smallest} cut a chunk file of up to {stride} bytes into too many segments"
            )));
        }
        if self.capacity_bytes < format::file_len(1) as u64 {
            return Err(EngineError::invalid(format!(
                "capacity_bytes is too small to hold one chunk (at least {} bytes), got {}",
                format::file_len(1),
                self.capacity_bytes
            )));
        }
        if let FreeSpaceReserve::AtLeast { fraction, .. } = self.min_free {
            if !(0.0..1.0).contains(&fraction) {
                return Err(EngineError::invalid(format!("min_free_fraction must be in [0, 1), not {fraction}")));
            }
        }
        if self.io_deadline == IoDeadline::After(Duration::ZERO) {
            return Err(EngineError::invalid("io_deadline must be > 0 seconds (None: derived from the chunk size)"));
        }
        Ok(())
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

    fn config() -> StoreConfig {
        StoreConfig::new(vec![PathBuf::from("/nonexistent")], "ns", 1 << 30)
    }

    #[test]
    fn validate_accepts_the_defaults_and_each_limit() {
        config().validate(1 << 20).unwrap();
        type Field = fn(&mut StoreConfig) -> &mut usize;
        let fields: [(Field, (usize, usize)); 5] = [
            (|c| &mut c.queue_depth, limits::QUEUE_DEPTH),
            (|c| &mut c.max_inflight, limits::MAX_INFLIGHT),
            (|c| &mut c.io_threads, limits::IO_THREADS),
            (|c| &mut c.chunk_workers, limits::CHUNK_WORKERS),
            (|c| &mut c.seal_buffers, limits::SEAL_BUFFERS),
        ];
        for (field, (lo, hi)) in fields {
            for v in [lo, hi] {
                let mut c = config();
                *field(&mut c) = v;
                c.validate(1 << 20).unwrap();
            }
        }
    }

    #[test]
    fn validate_refuses_each_bound_naming_it() {
        type Set = fn(&mut StoreConfig);
        let cases: [(Set, &str); 12] = [
            (|c| c.queue_depth = 0, "queue_depth must be in 1..=4096, got 0"),
            (|c| c.queue_depth = 4097, "queue_depth must be in 1..=4096, got 4097"),
            (|c| c.max_inflight = 0, "max_inflight must be in 1..=65536, got 0"),
            (|c| c.max_inflight = 65537, "max_inflight must be in 1..=65536, got 65537"),
            (|c| c.io_threads = 1025, "io_threads must be in 0..=1024 (0 = auto), got 1025"),
            (|c| c.chunk_workers = 1025, "chunk_workers must be in 0..=1024, got 1025"),
            (|c| c.segment_bytes = 100, "segment_bytes must be a positive multiple of 4096, got 100"),
            (|c| c.write_segment_bytes = 100, "write_segment_bytes must be 0 (whole chunk) or a multiple of 4096"),
            (|c| c.capacity_bytes = 4096, "capacity_bytes is too small to hold one chunk"),
            (|c| c.io_deadline = IoDeadline::After(Duration::ZERO), "io_deadline must be > 0 seconds"),
            (|c| c.seal_buffers = 0, "seal_buffers must be in 1..=1024, got 0"),
            (|c| c.encryption_previous_key_file = Some("/k".into()), "encryption_previous_key_file needs encryption_key_file"),
        ];
        for (set, message) in cases {
            let mut c = config();
            set(&mut c);
            let err = c.validate(1 << 20).unwrap_err().to_string();
            assert!(err.contains(message), "{err}");
        }
        let mut c = config();
        c.min_free = FreeSpaceReserve::AtLeast { bytes: 0, fraction: f64::NAN };
        assert!(c.validate(1 << 20).unwrap_err().to_string().contains("min_free_fraction"));
        let c = config();
        assert!(c.validate(usize::MAX).unwrap_err().to_string().contains("too many segments"));
    }

    #[test]
    fn the_default_deadline_follows_the_chunk_size_above_a_floor() {
        assert_eq!(default_deadline(28 << 20), DEADLINE_FLOOR);
        let big = default_deadline(256 << 20);
        assert!((big.as_secs_f64() - 4.0 * (256 << 20) as f64 / 100e6).abs() < 1e-6, "{big:?}");
    }

    #[test]
    fn io_deadlines_resolve() {
        assert_eq!(IoDeadline::Default.resolve(28 << 20), DEADLINE_FLOOR);
        assert_eq!(IoDeadline::After(Duration::from_millis(500)).resolve(1 << 20), Duration::from_millis(500));
        assert_eq!(IoDeadline::Never.resolve(1 << 20), NO_DEADLINE);
        assert_eq!(NO_DEADLINE.as_secs_f64(), limits::FOREVER_S);
    }
}
