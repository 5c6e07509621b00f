//! The engine's one error type. The PyO3 glue maps it to Python exceptions in
//! exactly one place (`python.rs`), the way polars' `error.rs` does.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("staging pool exhausted: no free slot within {waited_ms} ms ({num_slots} slots of {slot_bytes} bytes)")]
    PoolExhausted { waited_ms: u64, num_slots: usize, slot_bytes: usize },

    #[error("too many operations in flight ({max_inflight}); none completed within {waited_ms} ms")]
    QueueFull { waited_ms: u64, max_inflight: usize },

    #[error("no seal buffer free within {waited_ms} ms: {buffers} sealed puts in flight (seal_buffers)")]
    SealBuffersBusy { waited_ms: u64, buffers: usize },

    #[error("corrupt chunk {path}: {reason}")]
    Corrupt { path: String, reason: String },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },

    #[error("{0}")]
    BackendUnavailable(String),

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("{0}")]
    State(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;

impl EngineError {
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        EngineError::Io { context: context.into(), source }
    }

    pub fn last_os(context: impl Into<String>) -> Self {
        Self::io(context, io::Error::last_os_error())
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        EngineError::InvalidArgument(msg.into())
    }

    pub fn errno(&self) -> Option<i32> {
        match self {
            EngineError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// The value named `s` among `names` (same order as `values`), or an error
/// listing what is accepted: the one parser of every string-valued option.
pub(crate) fn parse_choice<T: Copy>(what: &str, s: &str, names: &[&str], values: &[T]) -> Result<T> {
    match names.iter().position(|n| *n == s) {
        Some(i) => Ok(values[i]),
        None => Err(EngineError::invalid(format!("{what} must be {}, not {s:?}", names.join("|")))),
    }
}
