//! The one wait-with-deadline loop: staging slots, operation entries,
//! operation outcomes, the index scan and the drain on close all wait for a
//! condition under a mutex, woken by a condition variable, until a deadline.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The deadline passed before the condition held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut;

/// `timeout` from now; None (no deadline) for none, and for a timeout past
/// what `Instant` can hold (`Duration::MAX`, Python's `inf`).
pub fn deadline_after(timeout: Option<Duration>) -> Option<Instant> {
    timeout.and_then(|t| Instant::now().checked_add(t))
}

/// Calls `ready` on the guarded state until it returns `Some`, sleeping on
/// `condvar` in between, until `deadline` (None: forever). `ready` runs at
/// least once, also when the deadline has passed already, so a zero timeout
/// is a non-blocking try. Whoever changes the state notifies `condvar` under
/// or after the same mutex, so no wake-up is lost.
pub fn wait_until<T, R>(
    mutex: &Mutex<T>,
    condvar: &Condvar,
    deadline: Option<Instant>,
    mut ready: impl FnMut(&mut T) -> Option<R>,
) -> Result<R, TimedOut> {
    let mut guard = mutex.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(r) = ready(&mut guard) {
            return Ok(r);
        }
        let left = match deadline {
            // Bounded sleeps even without a deadline: a spurious wake-up costs
            // one `ready` call, an hour-long sleep nothing.
            None => Duration::from_secs(3600),
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(l) if !l.is_zero() => l,
                _ => return Err(TimedOut),
            },
        };
        guard = condvar.wait_timeout(guard, left).unwrap_or_else(|e| e.into_inner()).0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_zero_timeout_tries_once_and_a_ready_state_returns_at_once() {
        let (m, c) = (Mutex::new(1), Condvar::new());
        assert_eq!(wait_until(&m, &c, deadline_after(Some(Duration::ZERO)), |v| (*v == 1).then_some("ready")), Ok("ready"));
        let t0 = Instant::now();
        assert_eq!(wait_until(&m, &c, deadline_after(Some(Duration::ZERO)), |v| (*v == 2).then_some(())), Err(TimedOut));
        assert!(t0.elapsed() < Duration::from_millis(50));
    }

    #[test]
    fn waits_until_notified_or_the_deadline() {
        let shared = Arc::new((Mutex::new(0), Condvar::new()));
        let s = shared.clone();
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            *s.0.lock().unwrap() = 7;
            s.1.notify_all();
        });
        let got = wait_until(&shared.0, &shared.1, None, |v| (*v != 0).then_some(*v));
        assert_eq!(got, Ok(7));
        setter.join().unwrap();
        let t0 = Instant::now();
        let r = wait_until(&shared.0, &shared.1, deadline_after(Some(Duration::from_millis(60))), |v| (*v == 8).then_some(()));
        assert_eq!(r, Err(TimedOut));
        assert!(t0.elapsed() >= Duration::from_millis(60));
        assert_eq!(deadline_after(Some(Duration::MAX)), None, "a deadline past the clock is none");
    }
}
