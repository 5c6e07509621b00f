//! Ready words: whether the read filling a staging slot has ended, readable
//! by every process that maps the pool.
//!
//! vLLM's scheduler process (the store) reads chunks into staging; its
//! workers copy them out. To let a worker's copy start while the read is
//! still in flight, each slot has one `u32` in the shared mapping (between
//! the slots and the trailer, `staging.rs`): `generation << 2 | state`.
//!
//! - The store *arms* the word when it starts a get into the slot: a new
//!   generation, state `PENDING`. Only the owner arms, and only a slot pinned
//!   for that get, so arms of one slot never race.
//! - The get's verdict *settles* it, once: `READY` (read and verified) or
//!   `FAILED` (a miss of any kind, corrupt, an error, or abandoned past the
//!   I/O deadline). A compare-and-swap from `(generation, PENDING)`: the first
//!   verdict wins (the deadline watchdog and a late completion can race), and
//!   a verdict for an older generation never touches a re-armed word.
//! - A waiter (a worker, in any process) waits for `(generation, READY)`,
//!   spinning briefly and then on a shared futex, until its deadline. Any
//!   other generation means the slot was recycled: never taken as ready.
//!
//! The generation is 30 bits and skips 0 (a word never armed); it wraps only
//! after 2^30 reads of one slot, and a waiter holds its slot (the manager's
//! load pin) for far less than that many reads.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::staging::StagingPool;

const STATE_BITS: u32 = 2;
const STATE_MASK: u32 = (1 << STATE_BITS) - 1;
const PENDING: u32 = 1;
const READY: u32 = 2;
const FAILED: u32 = 3;
/// Spins before the first futex wait: a read that ends within microseconds
/// (a staging-speed device) costs no system call.
const SPINS: u32 = 200;
/// Then yields the CPU, still polling, for this long before sleeping on the
/// futex: a waiter that sleeps gives up its CPU, and on a busy host it gets
/// it back only when the scheduler gets round to it, while reads of a few
/// MiB end within a millisecond or two. Yielding lets the threads finishing
/// the read (ring thread, checksum workers) run.
const YIELD_FOR: Duration = Duration::from_millis(2);

/// What a waiter learnt about one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// The read of this generation ended and its bytes are verified.
    Ready,
    /// The read of this generation ended without data (miss, corrupt, error, deadline).
    Failed,
    /// The word holds another generation: the slot was re-armed or never
    /// armed for this read. Never ready.
    Recycled,
    /// Still pending at the deadline.
    TimedOut,
}

impl Readiness {
    pub fn name(self) -> &'static str {
        match self {
            Readiness::Ready => "ready",
            Readiness::Failed => "failed",
            Readiness::Recycled => "recycled",
            Readiness::TimedOut => "timed_out",
        }
    }
}

fn word(generation: u32, state: u32) -> u32 {
    (generation << STATE_BITS) | state
}

fn generation_of(w: u32) -> u32 {
    w >> STATE_BITS
}

fn futex_wake_all(w: &AtomicU32) {
    // Shared (no FUTEX_PRIVATE_FLAG): waiters in other processes map the
    // same memfd page, and the kernel keys a shared futex by page and offset.
    // SAFETY: `w` is a live, 4-byte aligned futex word for the whole call; FUTEX_WAKE dereferences
    // no other argument.
    unsafe { libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE, i32::MAX, std::ptr::null::<libc::timespec>(), 0usize, 0u32) };
}

fn futex_wait(w: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // Returns at once if the word changed already (EAGAIN), on a wake-up, on
    // a signal or at the timeout: the caller re-reads the word in every case.
    // SAFETY: `w` is a live, 4-byte aligned futex word and `ts` a timespec, both alive across the
    // call, which only reads them.
    unsafe { libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec, 0usize, 0u32) };
}

impl StagingPool {
    /// Starts a new generation of `slot`'s ready word (state pending) and
    /// returns it. Called by the store for each get, before the get can end.
    pub(crate) fn arm_ready(&self, slot: usize) -> u32 {
        let w = self.ready_word(slot);
        let mut generation = (generation_of(w.load(Ordering::Relaxed)) + 1) & (u32::MAX >> STATE_BITS);
        if generation == 0 {
            generation = 1;
        }
        w.store(word(generation, PENDING), Ordering::Release);
        generation
    }

    /// The verdict of the get of `generation` on `slot`: ready (`ok`) or
    /// failed. Only the first verdict of a generation counts; returns whether
    /// this one did. Release ordering: a waiter that sees ready sees the bytes.
    pub(crate) fn settle_ready(&self, slot: usize, generation: u32, ok: bool) -> bool {
        if generation == 0 || slot >= self.num_slots() {
            return false;
        }
        let w = self.ready_word(slot);
        let settled = word(generation, if ok { READY } else { FAILED });
        let won = w.compare_exchange(word(generation, PENDING), settled, Ordering::AcqRel, Ordering::Acquire).is_ok();
        if won {
            futex_wake_all(w);
        }
        won
    }

    /// `(generation, state)` of `slot`'s word; state is "idle" (never armed),
    /// "pending", "ready" or "failed".
    pub fn ready_state(&self, slot: usize) -> (u32, &'static str) {
        let w = self.ready_word(slot).load(Ordering::Acquire);
        let state = match w & STATE_MASK {
            PENDING => "pending",
            READY => "ready",
            FAILED => "failed",
            _ => "idle",
        };
        (generation_of(w), state)
    }

    /// Waits until the read of `generation` into `slot` has ended, at most
    /// until `deadline`.
    pub fn wait_ready(&self, slot: usize, generation: u32, deadline: Instant) -> Readiness {
        let w = self.ready_word(slot);
        let mut spins = 0;
        let mut yield_until: Option<Instant> = None;
        loop {
            let now = w.load(Ordering::Acquire);
            if generation == 0 || generation_of(now) != generation {
                return Readiness::Recycled;
            }
            match now & STATE_MASK {
                READY => return Readiness::Ready,
                FAILED => return Readiness::Failed,
                _ => {}
            }
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let until = *yield_until.get_or_insert_with(|| Instant::now() + YIELD_FOR);
            if Instant::now() < until.min(deadline) {
                std::thread::yield_now();
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Readiness::TimedOut;
            }
            // Bounded sleeps: a wake-up lost to a publisher in a process that
            // died mid-way costs at most this much, not the whole deadline.
            futex_wait(w, now, left.min(Duration::from_millis(50)));
        }
    }

    /// `wait_ready` for several slots under one deadline, in order.
    pub fn wait_ready_all(&self, slots: &[(usize, u32)], deadline: Instant) -> Vec<Readiness> {
        slots.iter().map(|&(slot, generation)| self.wait_ready(slot, generation, deadline)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::Backing;
    use std::sync::Arc;

    fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    #[test]
    fn a_waiter_sees_ready_only_for_its_generation() {
        let pool = StagingPool::create(4096, 2, None).unwrap();
        assert_eq!(pool.ready_state(0), (0, "idle"));
        assert_eq!(pool.wait_ready(0, 1, soon(10)), Readiness::Recycled, "never armed: not ready");
        let g = pool.arm_ready(0);
        assert_eq!(pool.ready_state(0), (g, "pending"));
        assert_eq!(pool.wait_ready(0, g, soon(20)), Readiness::TimedOut);
        assert!(pool.settle_ready(0, g, true));
        assert_eq!(pool.wait_ready(0, g, soon(0)), Readiness::Ready);
        assert!(!pool.settle_ready(0, g, false), "the first verdict wins");
        assert_eq!(pool.ready_state(0), (g, "ready"));
        // Recycled: the slot is armed for another read. The old generation's
        // waiter must never take it as ready, not even once it is ready.
        let g2 = pool.arm_ready(0);
        assert_ne!(g, g2);
        assert!(!pool.settle_ready(0, g, true), "a verdict for an old generation changes nothing");
        assert_eq!(pool.ready_state(0), (g2, "pending"));
        assert!(pool.settle_ready(0, g2, true));
        assert_eq!(pool.wait_ready(0, g, soon(0)), Readiness::Recycled);
        assert_eq!(pool.wait_ready(0, g2, soon(0)), Readiness::Ready);
        // Words are per slot.
        assert_eq!(pool.ready_state(1), (0, "idle"));
    }

    #[test]
    fn a_failed_read_wakes_the_waiter_with_failed() {
        let pool = Arc::new(StagingPool::create(4096, 1, None).unwrap());
        let g = pool.arm_ready(0);
        let p = pool.clone();
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            (p.wait_ready(0, g, soon(5000)), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(pool.settle_ready(0, g, false));
        let (verdict, waited) = t.join().unwrap();
        assert_eq!(verdict, Readiness::Failed);
        assert!(waited < Duration::from_secs(2), "woken, not timed out: {waited:?}");
    }

    #[test]
    fn generations_wrap_past_zero() {
        let pool = StagingPool::create(4096, 1, None).unwrap();
        pool.ready_word(0).store(word(u32::MAX >> STATE_BITS, READY), Ordering::Relaxed);
        assert_eq!(pool.arm_ready(0), 1, "generation 0 means never armed");
    }

    /// The worker's side in another process: a second mapping of the memfd
    /// (what `attach_memfd` gives a vLLM worker) in a forked child waits on
    /// the word the owner settles.
    #[test]
    fn a_waiter_in_another_process_is_woken() {
        let name = format!("pykvcache-test-ready-{}", std::process::id());
        let pool = StagingPool::create_backed(4096, 2, Backing::Memfd(&name)).unwrap();
        let g = pool.arm_ready(1);
        // SAFETY: the child, a copy of this multi-threaded test process, never returns into the
        // test harness: it runs the block below and leaves with `_exit`. glibc's malloc takes its
        // locks around fork, so the child may allocate.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // Child: its own mapping of the region, found through /proc.
            let code = match StagingPool::attach_memfd(&name) {
                Ok(other) => {
                    let start = Instant::now();
                    match other.wait_ready(1, g, soon(5000)) {
                        Readiness::Ready if start.elapsed() < Duration::from_secs(3) => 0,
                        Readiness::Ready => 3,
                        _ => 2,
                    }
                }
                Err(_) => 1,
            };
            // SAFETY: ends the child at once, without unwinding into the harness or running
            // destructors of the parent's state.
            unsafe { libc::_exit(code) };
        }
        std::thread::sleep(Duration::from_millis(200));
        assert!(pool.settle_ready(1, g, true));
        let mut status = 0;
        // SAFETY: `status` is a live, writable int; `pid` is this process's child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child did not exit: {status}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "1: attach failed, 2: not ready, 3: not woken");
    }
}
