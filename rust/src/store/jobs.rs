//! CPU work per chunk, kept off both the submitting thread (vLLM's scheduler
//! calls `put`/`get` on its hot path) and the ring thread (which should only
//! move bytes): sealing a chunk (payload CRC + header) before its write is
//! submitted, checksumming each segment of a read as soon as it lands (so
//! that verification overlaps the rest of the transfer), and verifying /
//! publishing a chunk once its transfer completed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use crate::backend::Segment;
use crate::ops::{Finished, OpId};

use super::OpContext;

pub enum Job {
    /// Checksum a put's payload (already being written) and write its header.
    /// `header`: the header block's transfer; `payload`: the payload's address.
    Seal { id: OpId, header: super::transfer::Transfer, payload: usize, payload_len: usize },
    /// Seal a share of a put's frames into its seal buffer (one job per chunk
    /// worker), queueing the writes as they become ready, the header last (`sealing`).
    SealFrames(super::sealing::SealJob),
    /// One segment of a fully verified or sealed read landed: checksum its
    /// payload piece, or open the frames it completes.
    VerifyPiece { seg: Segment },
    /// The transfer completed: verify (get) or publish (put), then complete.
    Finish(Finished<OpContext>),
}

#[derive(Default)]
pub struct JobQueue {
    state: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
    cpu_ns: Mutex<Vec<AtomicU64>>,
}

impl JobQueue {
    pub fn push(&self, job: Job) {
        self.state.lock().unwrap().0.push_back(job);
        self.ready.notify_one();
    }

    /// Next job, or None once stopped and empty.
    pub fn pop(&self) -> Option<Job> {
        let mut st = self.state.lock().unwrap();
        loop {
            if let Some(job) = st.0.pop_front() {
                return Some(job);
            }
            if st.1 {
                return None;
            }
            st = self.ready.wait(st).unwrap();
        }
    }

    pub fn stop(&self) {
        self.state.lock().unwrap().1 = true;
        self.ready.notify_all();
    }

    pub fn register_worker(&self) -> usize {
        let mut v = self.cpu_ns.lock().unwrap();
        v.push(AtomicU64::new(0));
        v.len() - 1
    }

    pub fn record_cpu(&self, worker: usize, ns: u64) {
        self.cpu_ns.lock().unwrap()[worker].store(ns, Ordering::Relaxed);
    }

    pub fn cpu_time_ns(&self) -> u64 {
        self.cpu_ns.lock().unwrap().iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

/// Work that touches one storage directory with syscalls that can block for
/// as long as the directory is unreachable (open, stat, rename, unlink,
/// close). It runs on that directory's own workers (`health::DIR_WORKERS`),
/// never on the caller's, the ring's or the chunk workers' threads.
pub enum DirJob {
    /// Open the chunk file of a get and submit its transfer.
    OpenRead { id: OpId, ctx: OpContext },
    /// Make room, open or claim a file for a put and submit its transfer.
    OpenWrite { id: OpId, ctx: OpContext },
    /// Close a file after a transfer that ended on the ring thread.
    Close { fd: i32, direct: bool },
    /// `probe(key)`: one lstat; the answer is indexed and given to the waiter.
    Lstat { hash: u128, reply: std::sync::Arc<LstatReply> },
    /// Unlink an evicted chunk's file; whether it was there goes to the waiter.
    /// `len`: its length as indexed (None: not indexed), for the capacity ledger.
    Unlink { hash: u128, len: Option<u64>, reply: std::sync::Arc<LstatReply> },
    /// The breaker's probe numbered so.
    Probe { number: u64 },
}

#[derive(Default)]
pub struct LstatReply {
    pub found: Mutex<Option<bool>>,
    pub ready: Condvar,
}

/// One directory's queue of `DirJob`s.
#[derive(Default)]
pub struct DirQueue {
    state: Mutex<(VecDeque<DirJob>, bool)>,
    ready: Condvar,
}

impl DirQueue {
    pub fn push(&self, job: DirJob) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0.push_back(job);
        self.ready.notify_one();
    }

    /// Next job, or None once stopped and empty.
    pub fn pop(&self) -> Option<DirJob> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(job) = st.0.pop_front() {
                return Some(job);
            }
            if st.1 {
                return None;
            }
            st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub fn stop(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.ready.notify_all();
    }
}
