//! A stalled or dead storage directory never stalls serving (decision 0031).
//!
//! - **Deadlines.** Every get and put carries one (`StoreConfig::io_deadline`,
//!   default `config::default_deadline`; `IoDeadline::Never` is `NO_DEADLINE`, which
//!   no operation reaches). The watchdog thread abandons an operation
//!   that is past it *and* whose directory made no progress (completed no
//!   operation) for as long, or that is past `HARD_DEADLINE_FACTOR` times it
//!   whatever its directory did: the caller gets a miss (get) or a skipped
//!   put (errno ETIMEDOUT) at once; the staging slot stays quarantined
//!   (`StagingPool::quarantine`) until the kernel really ends the transfer,
//!   and the operation's late completion only cleans up.
//! - **Nothing blocking on the caller's or the ring's thread.** The opens,
//!   stats, renames and unlinks a get or put needs run on the directory's own
//!   workers (`DIR_WORKERS` threads per root, `jobs::DirQueue`): a stuck
//!   syscall holds one of those, never the caller, the ring thread or another
//!   directory's workers.
//! - **A circuit breaker per directory.** `BREAKER_THRESHOLD` timeouts or
//!   I/O errors of the "storage unreachable" kind (EIO, ENOTCONN, ESTALE...)
//!   in a row open it: gets there are misses and puts are skipped (counted)
//!   at once, without touching the directory. After a back-off (the deadline,
//!   `BACKOFF_CAP` without one, doubled on each failed probe up to `BACKOFF_CAP`) one small probe
//!   (statvfs + write/read/unlink of a 4 KiB file) runs on a directory
//!   worker: success closes the breaker, failure or no answer within the
//!   deadline opens it again. Each state change is one notice (logged once by
//!   the Python layer), never one line per chunk.
//! - **Bounded cost of stuck work.** At most `STUCK_CAP` abandoned
//!   operations per directory; beyond that new ones fail fast there like
//!   with an open breaker.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::notice::Notice;

pub const DIR_WORKERS: usize = 2;
pub const BREAKER_THRESHOLD: u32 = 3;
pub const STUCK_CAP: usize = 64;
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);
/// A single operation is abandoned past this many deadlines even while its
/// directory completes others.
pub const HARD_DEADLINE_FACTOR: u32 = 8;
/// How long `probe(key)` (an lstat, on the caller's thread in vLLM's
/// scheduler) waits for its answer before saying "not there".
pub const PROBE_WAIT: Duration = Duration::from_millis(250);
/// How often the probe of a directory found gone (deleted, moved away, its
/// filesystem unmounted) looks again: such a probe answers at once (ENOENT),
/// holds no worker, and the directory should work again within seconds of
/// its return, so it never backs off like a stalled one.
pub const GONE_RETRY: Duration = Duration::from_secs(1);
const MAX_NOTICES: usize = 256;

/// The breaker's first back-off: the deadline (a probe may take that long to
/// answer), `BACKOFF_CAP` for a store without one (`NO_DEADLINE`), so that an
/// open breaker still probes.
fn first_backoff(deadline: Duration) -> Duration {
    if deadline >= super::config::NO_DEADLINE {
        BACKOFF_CAP
    } else {
        deadline
    }
}

/// errnos that say the storage is unreachable or broken, not that a file is
/// absent or the disk full: they count towards opening the breaker.
pub fn is_storage_failure(errno: i32) -> bool {
    matches!(
        errno,
        libc::EIO
            | libc::ENOTCONN
            | libc::ESTALE
            | libc::ETIMEDOUT
            | libc::EHOSTDOWN
            | libc::EHOSTUNREACH
            | libc::ENETDOWN
            | libc::ENETUNREACH
            | libc::ECONNRESET
            | libc::ECONNABORTED
            | libc::ENODEV
            | libc::ENXIO
            | libc::EREMOTEIO
            | libc::ESHUTDOWN
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn name(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half-open",
        }
    }
}

struct Breaker {
    state: BreakerState,
    failures: u32,
    backoff: Duration,
    reopen_at: Instant,
    /// The probe in flight: its number and when it was queued.
    probe: Option<(u64, Instant)>,
    probes: u64,
    /// Opened because the directory is gone (`Health::gone`): probed every
    /// `GONE_RETRY`, each probe counted but not logged.
    gone: bool,
}

/// One storage directory's health: its breaker, its progress clock and the
/// operations abandoned there.
pub struct DirHealth {
    pub path: PathBuf,
    breaker: Mutex<Breaker>,
    /// Nanoseconds since `epoch` of the last operation that ended here.
    last_progress_ns: AtomicU64,
    pub stuck: AtomicU64,
}

/// What the breaker counted, over all directories.
#[derive(Default)]
pub struct HealthCounters {
    pub timeouts: AtomicU64,
    pub storage_errors: AtomicU64,
    pub breaker_opens: AtomicU64,
    pub skipped_gets: AtomicU64,
    pub skipped_puts: AtomicU64,
    pub probes: AtomicU64,
    pub probe_failures: AtomicU64,
    /// Probes that closed a breaker: with `breaker_opens`, tells a caller that
    /// polls now and then (the vLLM gate) that an outage began or ended since
    /// it last looked, even when it never saw the breaker open.
    pub breaker_closes: AtomicU64,
    pub late_completions: AtomicU64,
}

pub struct Health {
    pub dirs: Vec<DirHealth>,
    pub deadline: Duration,
    epoch: Instant,
    pub counters: HealthCounters,
    /// State changes, for the caller to log (the engine has no logger).
    notices: Mutex<VecDeque<Notice>>,
}

/// What the watchdog should do for a directory now.
pub enum Due {
    Nothing,
    /// Queue the probe numbered so.
    Probe(u64),
}

impl Health {
    pub fn new(paths: &[PathBuf], deadline: Duration) -> Self {
        let now = Instant::now();
        let backoff = first_backoff(deadline);
        let dirs = paths
            .iter()
            .map(|p| DirHealth {
                path: p.clone(),
                breaker: Mutex::new(Breaker {
                    state: BreakerState::Closed,
                    failures: 0,
                    backoff,
                    reopen_at: now,
                    probe: None,
                    probes: 0,
                    gone: false,
                }),
                last_progress_ns: AtomicU64::new(0),
                stuck: AtomicU64::new(0),
            })
            .collect();
        Health { dirs, deadline, epoch: now, counters: HealthCounters::default(), notices: Mutex::new(VecDeque::new()) }
    }

    fn ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    fn breaker(&self, root: usize) -> std::sync::MutexGuard<'_, Breaker> {
        self.dirs[root].breaker.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notice(&self, notice: Notice) {
        let mut n = self.notices.lock().unwrap_or_else(|e| e.into_inner());
        if n.len() < MAX_NOTICES {
            n.push_back(notice);
        }
    }

    pub fn take_notices(&self) -> Vec<Notice> {
        self.notices.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect()
    }

    pub fn state(&self, root: usize) -> BreakerState {
        self.breaker(root).state
    }

    /// Why a new operation on `root` must not touch it now; None when it may.
    pub fn refusal(&self, root: usize) -> Option<String> {
        let d = &self.dirs[root];
        let state = self.breaker(root).state;
        if state != BreakerState::Closed {
            return Some(format!("{} is unavailable (circuit breaker {})", d.path.display(), state.name()));
        }
        let stuck = d.stuck.load(Ordering::Relaxed);
        if stuck >= STUCK_CAP as u64 {
            return Some(format!("{} has {stuck} operations stuck in the kernel", d.path.display()));
        }
        None
    }

    /// An operation on `root` ended (in time or late): the directory answers.
    pub fn progress(&self, root: usize) {
        self.dirs[root].last_progress_ns.store(self.ns(Instant::now()), Ordering::Relaxed);
    }

    /// Whether an operation on `root` started at `since` is past its deadline.
    pub fn overdue(&self, root: usize, since: Instant, now: Instant) -> bool {
        let d = self.deadline;
        let age = now.saturating_duration_since(since);
        if age < d {
            return false;
        }
        if age >= d * HARD_DEADLINE_FACTOR {
            return true;
        }
        let last = self.dirs[root].last_progress_ns.load(Ordering::Relaxed);
        self.ns(now).saturating_sub(last) >= d.as_nanos() as u64
    }

    /// An operation ended in time without a storage failure.
    pub fn success(&self, root: usize) {
        self.progress(root);
        let mut b = self.breaker(root);
        if b.state == BreakerState::Closed {
            b.failures = 0;
        }
    }

    /// A timeout (`timed_out`) or a storage-failure errno on `root`.
    pub fn failure(&self, root: usize, timed_out: bool, now: Instant) {
        let c = if timed_out { &self.counters.timeouts } else { &self.counters.storage_errors };
        c.fetch_add(1, Ordering::Relaxed);
        let mut b = self.breaker(root);
        b.failures += 1;
        if b.state == BreakerState::Closed && b.failures >= BREAKER_THRESHOLD {
            b.state = BreakerState::Open;
            b.backoff = first_backoff(self.deadline);
            b.reopen_at = now + b.backoff;
            self.counters.breaker_opens.fetch_add(1, Ordering::Relaxed);
            let what = if timed_out { "timed out" } else { "failed" };
            self.notice(Notice::warning(format!(
                "storage directory {}: circuit breaker closed -> open ({} operations {what} in a row); gets are misses and puts are skipped there, probe in {:.1} s",
                self.dirs[root].path.display(),
                b.failures,
                b.backoff.as_secs_f64()
            )));
        }
    }

    /// `root`'s directory is gone (`what`): the breaker opens at once, not
    /// after `BREAKER_THRESHOLD` failures (every operation there would fail),
    /// and its probe looks again every `GONE_RETRY` until the directory is
    /// back. One notice, however long it stays gone.
    pub fn gone(&self, root: usize, what: &str, now: Instant) {
        let mut b = self.breaker(root);
        if b.gone {
            return;
        }
        b.gone = true;
        let from = b.state;
        match from {
            BreakerState::Closed => {
                b.state = BreakerState::Open;
                b.reopen_at = now + GONE_RETRY;
                self.counters.breaker_opens.fetch_add(1, Ordering::Relaxed);
            }
            BreakerState::Open => b.reopen_at = b.reopen_at.min(now + GONE_RETRY),
            // The probe in flight answers (or times out) and decides.
            BreakerState::HalfOpen => {}
        }
        self.notice(Notice::warning(format!(
            "storage directory {}: {what}: circuit breaker {} -> open; gets are misses and puts are skipped there, \
             checked every {:.1} s until it is back (the store never creates its storage directory again: it may be \
             an unmounted filesystem's mountpoint)",
            self.dirs[root].path.display(),
            from.name(),
            GONE_RETRY.as_secs_f64()
        )));
    }

    /// Whether `root`'s breaker is open because its directory is gone.
    pub fn is_gone(&self, root: usize) -> bool {
        self.breaker(root).gone
    }

    /// The watchdog's look at `root`: time for a probe, or a probe that did
    /// not answer within the deadline (the breaker opens again).
    pub fn tick(&self, root: usize, now: Instant) -> Due {
        let mut b = self.breaker(root);
        match b.state {
            BreakerState::Open if now >= b.reopen_at => {
                b.state = BreakerState::HalfOpen;
                b.probes += 1;
                b.probe = Some((b.probes, now));
                self.counters.probes.fetch_add(1, Ordering::Relaxed);
                if !b.gone {
                    self.notice(Notice::info(format!(
                        "storage directory {}: circuit breaker open -> half-open (probing)",
                        self.dirs[root].path.display()
                    )));
                }
                Due::Probe(b.probes)
            }
            BreakerState::HalfOpen => {
                if let Some((_, queued)) = b.probe {
                    if now.saturating_duration_since(queued) >= self.deadline {
                        // A directory that stops answering is stalled, not gone: back off.
                        b.gone = false;
                        self.reopen(&mut b, root, now, "no answer within the deadline");
                    }
                }
                Due::Nothing
            }
            _ => Due::Nothing,
        }
    }

    /// The result of probe `number` (ignored when it came too late: the
    /// breaker moved on).
    pub fn probe_result(&self, root: usize, number: u64, result: std::io::Result<()>, now: Instant) {
        let mut b = self.breaker(root);
        if b.state != BreakerState::HalfOpen || b.probe.map(|p| p.0) != Some(number) {
            return;
        }
        match result {
            Ok(()) => {
                let was_gone = std::mem::take(&mut b.gone);
                b.state = BreakerState::Closed;
                b.failures = 0;
                b.backoff = first_backoff(self.deadline);
                b.probe = None;
                drop(b);
                self.counters.breaker_closes.fetch_add(1, Ordering::Relaxed);
                self.progress(root);
                let how = if was_gone { "the directory is back" } else { "probe succeeded" };
                self.notice(Notice::info(format!(
                    "storage directory {}: circuit breaker half-open -> closed ({how})",
                    self.dirs[root].path.display()
                )));
            }
            Err(e) => self.reopen(&mut b, root, now, &e.to_string()),
        }
    }

    fn reopen(&self, b: &mut Breaker, root: usize, now: Instant, why: &str) {
        self.counters.probe_failures.fetch_add(1, Ordering::Relaxed);
        b.state = BreakerState::Open;
        b.probe = None;
        if b.gone {
            // Still gone: look again soon, quietly (the `gone` notice said so).
            b.reopen_at = now + GONE_RETRY;
            return;
        }
        b.backoff = (b.backoff * 2).min(BACKOFF_CAP.max(first_backoff(self.deadline)));
        b.reopen_at = now + b.backoff;
        self.notice(Notice::warning(format!(
            "storage directory {}: circuit breaker half-open -> open (probe: {why}); next probe in {:.1} s",
            self.dirs[root].path.display(),
            b.backoff.as_secs_f64()
        )));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notice::Level;

    #[test]
    fn the_breaker_opens_probes_backs_off_and_closes_with_one_notice_per_change() {
        let d = Duration::from_millis(100);
        let h = Health::new(&[PathBuf::from("/x")], d);
        let t0 = Instant::now();
        h.failure(0, true, t0);
        h.success(0); // resets the run
        h.failure(0, true, t0);
        h.failure(0, false, t0);
        assert!(h.refusal(0).is_none(), "2 in a row: still closed");
        h.failure(0, true, t0);
        assert_eq!(h.state(0), BreakerState::Open);
        assert!(h.refusal(0).unwrap().contains("breaker open"));
        h.failure(0, true, t0); // more failures while open: no new notice
        assert!(matches!(h.tick(0, t0 + d / 2), Due::Nothing), "back-off not over");
        let Due::Probe(n) = h.tick(0, t0 + d) else { panic!("probe due") };
        assert_eq!(h.state(0), BreakerState::HalfOpen);
        h.probe_result(0, n, Err(std::io::Error::from_raw_os_error(libc::ENOTCONN)), t0 + d);
        assert_eq!(h.state(0), BreakerState::Open);
        // Doubled back-off: not yet at d, due at 2d after the failure.
        assert!(matches!(h.tick(0, t0 + d + d), Due::Nothing));
        let Due::Probe(m) = h.tick(0, t0 + d + 2 * d) else { panic!("probe due") };
        // A probe that never answers counts as failed after the deadline.
        assert!(matches!(h.tick(0, t0 + 4 * d), Due::Nothing));
        assert_eq!(h.state(0), BreakerState::Open);
        h.probe_result(0, m, Ok(()), t0 + 4 * d); // too late: ignored
        assert_eq!(h.state(0), BreakerState::Open);
        let Due::Probe(k) = h.tick(0, t0 + 9 * d) else { panic!("probe due") };
        h.probe_result(0, k, Ok(()), t0 + 9 * d);
        assert_eq!(h.state(0), BreakerState::Closed);
        let notices = h.take_notices();
        let expected = [
            "closed -> open",
            "open -> half-open",
            "half-open -> open",
            "open -> half-open",
            "half-open -> open",
            "open -> half-open",
            "half-open -> closed",
        ];
        assert_eq!(notices.len(), expected.len(), "{notices:#?}");
        for (n, e) in notices.iter().zip(expected) {
            assert!(n.text.contains(&format!("circuit breaker {e} ")), "{n:?} is not {e}");
            // A directory failing is a warning; probing and recovering are news.
            let level = if e.ends_with("-> open") { Level::Warning } else { Level::Info };
            assert_eq!(n.level, level, "{n:?}");
        }
        assert_eq!(h.counters.breaker_opens.load(Ordering::Relaxed), 1);
        assert_eq!(h.counters.probe_failures.load(Ordering::Relaxed), 2);
        assert_eq!(h.counters.breaker_closes.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn an_operation_is_overdue_only_when_its_directory_also_stopped_progressing() {
        let d = Duration::from_millis(100);
        let h = Health::new(&[PathBuf::from("/x")], d);
        let since = Instant::now();
        assert!(!h.overdue(0, since, since + d / 2));
        h.progress(0);
        let now = Instant::now();
        assert!(!h.overdue(0, since, now.max(since + d)), "the directory just completed something");
        assert!(h.overdue(0, since, now + d + d / 10), "no progress for a deadline");
        assert!(h.overdue(0, since, since + d * HARD_DEADLINE_FACTOR), "the hard limit");
    }

    #[test]
    fn without_a_deadline_nothing_is_overdue_and_an_open_breaker_still_probes() {
        let h = Health::new(&[PathBuf::from("/x")], super::super::config::NO_DEADLINE);
        let since = Instant::now();
        let years = Duration::from_secs(10 * 365 * 86_400);
        assert!(!h.overdue(0, since, since + years), "no deadline: never abandoned");
        for _ in 0..BREAKER_THRESHOLD {
            h.failure(0, false, since); // storage errnos still open the breaker
        }
        assert_eq!(h.state(0), BreakerState::Open);
        assert!(matches!(h.tick(0, since + BACKOFF_CAP / 2), Due::Nothing));
        let Due::Probe(n) = h.tick(0, since + BACKOFF_CAP) else { panic!("probe due after BACKOFF_CAP") };
        h.probe_result(0, n, Err(std::io::Error::from_raw_os_error(libc::EIO)), since + BACKOFF_CAP);
        assert!(matches!(h.tick(0, since + 2 * BACKOFF_CAP), Due::Probe(_)), "the back-off stays at the cap");
    }
}
