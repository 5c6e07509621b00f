//! Messages the engine hands its caller to log: the engine has no logger,
//! and its threads (chunk workers, the watchdog) must not call into Python.
//! Each carries its level, decided where the message is written, so that the
//! glue never classifies a message by matching its text.

/// How the caller should log a notice (Python: `logging.INFO` / `WARNING`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// News: a state change back to normal, a probe started.
    Info,
    /// Something the operator should see: a directory failing, capacity lost.
    Warning,
}

impl Level {
    /// The name of the Python `logging` method that logs at this level.
    pub fn name(self) -> &'static str {
        match self {
            Level::Info => "info",
            Level::Warning => "warning",
        }
    }
}

/// One message for the caller's log: a level and the text (no prefix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    pub level: Level,
    pub text: String,
}

impl Notice {
    pub fn info(text: impl Into<String>) -> Self {
        Notice { level: Level::Info, text: text.into() }
    }

    pub fn warning(text: impl Into<String>) -> Self {
        Notice { level: Level::Warning, text: text.into() }
    }
}
