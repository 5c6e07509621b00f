//! pykvcache engine: an io_uring + O_DIRECT chunk store for LLM KV caches,
//! with a bounded, shareable staging pool. Free of Python; the PyO3 glue is
//! the `python` module, compiled only with the `python` feature.
//!
//! Layers, bottom up (each uses only its own line and those above it, and no
//! module cycle: `tests/tools/test_rust_layering.py`):
//! - `error`, `checksum`, `wait`, `stats`, `notice`, `faults`: shared pieces;
//! - `digest`: content digest of a file's bytes (the vLLM integration's
//!   weights identity; no other layer uses it);
//! - `disk`: the on-disk layer (chunk format, directory layout, file
//!   operations, the index of what is on disk and the scan that rebuilds it);
//! - `staging`, `ready`: the shared staging pool the bytes move through, and
//!   its slots' ready words (seen by every process that maps the pool);
//! - `backend`: moves segments between staging and files (io_uring, threads);
//! - `ops`: the generic table of operations in flight (backpressure, handles);
//! - `store`: put/get as stages over all of these (see its module docs for
//!   the life of a get and of a put);
//! - `python` (feature `python`): the only PyO3 file.
//!
//! Modules are crate-private; what Python, the tests and the benches use is
//! re-exported below.

pub(crate) mod backend;
pub(crate) mod checksum;
pub(crate) mod digest;
pub(crate) mod disk;
pub(crate) mod error;
pub(crate) mod faults;
pub(crate) mod notice;
pub(crate) mod ops;
pub(crate) mod ready;
pub(crate) mod staging;
pub(crate) mod stats;
pub(crate) mod store;
pub(crate) mod wait;

#[cfg(feature = "python")]
mod python;

pub use disk::files::DirectIoPolicy;
pub use disk::format::{file_len as chunk_file_bytes, key_hash, FORMAT_VERSION, HEADER_BYTES, IO_ALIGN};
pub use error::{EngineError, Result};
pub use faults::{FaultPlan, SharedFaults};
pub use notice::{Level, Notice};
pub use ops::{MissKind, OpId, Outcome, Status};
pub use ready::Readiness;
pub use staging::StagingPool;
pub use stats::Stats;
pub use store::config::defaults;
pub use store::{
    BackendChoice, BlockStore, FreeSpaceReserve, OpenReport, RegionId, SealingSnapshot, SegmentFiles, StoreConfig, StoreSnapshot,
    VerifyPolicy,
};
