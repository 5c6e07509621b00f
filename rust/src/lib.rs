//! pykvcache engine: an io_uring + O_DIRECT chunk store for LLM KV caches,
//! with a bounded, shareable staging pool. Free of Python; the PyO3 glue is
//! the `python` module, compiled only with the `python` feature.

pub mod backend;
pub mod checksum;
pub mod chunk_workers;
pub mod error;
pub mod files;
pub mod format;
pub mod index;
pub mod layout;
pub mod ops;
pub mod scan;
pub mod staging;
pub mod stats;
pub mod store;

#[cfg(feature = "python")]
mod python;

pub use error::{EngineError, Result};
pub use staging::StagingPool;
pub use store::{BackendChoice, BlockStore, FreeSpaceReserve, StoreConfig, VerifyPolicy};
