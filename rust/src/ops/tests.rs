//! The op table's tests (the table alone, no store).

use super::*;
use std::sync::Arc;

/// What an operation carries does not matter to the table: a label here.
type Table = OpTable<&'static str>;

fn ok() -> Outcome {
    Outcome::new(Status::Ok, 0, None, "")
}

#[test]
fn a_refused_submission_gives_its_entry_back() {
    // `release` of an entry that was never started
    // marked it detached and it stayed busy for good.
    let ops = Table::new(2).unwrap();
    for _ in 0..10 {
        let id = ops.allocate(Some(Duration::ZERO)).unwrap();
        ops.cancel(id);
    }
    assert_eq!(ops.in_flight(), 0);
    let a = ops.allocate(Some(Duration::ZERO)).unwrap();
    let b = ops.allocate(Some(Duration::ZERO)).unwrap();
    assert_ne!(a.index, b.index, "both entries are free again");
    assert!(matches!(ops.allocate(Some(Duration::ZERO)), Err(EngineError::QueueFull { .. })));
    assert!(ops.is_done(OpId { index: a.index, generation: a.generation.wrapping_sub(1) }).is_err(), "old handles stay stale");
}

#[test]
fn close_wakes_waiters_and_refuses_unstarted_operations() {
    // A caller waiting for an entry while the store
    // closes must fail, not take an entry after the drain.
    let ops = Arc::new(Table::new(1).unwrap());
    let held = ops.allocate(None).unwrap();
    let o = ops.clone();
    let waiter = std::thread::spawn(move || o.allocate(Some(Duration::from_secs(30))));
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    ops.close();
    let err = waiter.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("closed"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // Reserved before the close, started after it: refused, context given back.
    assert_eq!(ops.start(held, "get", 1), Err("get"));
    // Not started, so the drain does not wait for it (it would hang).
    assert!(ops.drain(None));
    ops.complete(held, Outcome::new(Status::Error, 0, None, "closed"));
    ops.release(held);
    assert_eq!(ops.in_flight(), 0);
    assert!(ops.allocate(Some(Duration::ZERO)).is_err(), "closed tables reserve nothing");
}

#[test]
fn started_operations_are_drained_and_may_restart_while_closing() {
    let ops = Arc::new(Table::new(1).unwrap());
    let id = ops.allocate(None).unwrap();
    assert!(ops.start(id, "put", 1).is_ok());
    ops.close();
    // A put's rewrite after ENOSPC restarts a started operation: accepted.
    let done = ops.segment_done(id.index, Ok(())).unwrap().unwrap();
    assert!(ops.start(id, done.ctx, 1).is_ok());
    let o = ops.clone();
    let finisher = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        o.segment_done(id.index, Ok(())).unwrap().unwrap();
        o.complete(id, ok());
    });
    assert!(ops.drain(None));
    assert!(ops.is_done(id).unwrap(), "drain returned before the started operation completed");
    finisher.join().unwrap();
}

#[test]
fn huge_wait_timeouts_do_not_overflow_the_clock() {
    let ops = Table::new(1).unwrap();
    let id = ops.allocate(None).unwrap();
    assert!(ops.start(id, "get", 1).is_ok());
    ops.segment_done(id.index, Ok(())).unwrap().unwrap();
    ops.complete(id, ok());
    // `Instant::now() + Duration::MAX` panics; a deadline past the clock is none.
    assert!(ops.wait(id, Some(Duration::MAX)).unwrap().is_some());
}

#[test]
fn the_last_segment_returns_the_context_with_the_first_error() {
    let ops = Table::new(1).unwrap();
    let id = ops.allocate(None).unwrap();
    ops.start(id, "get", 3).unwrap();
    assert!(ops.segment_done(id.index, Ok(())).unwrap().is_none());
    assert!(ops.segment_done(id.index, Err(SegmentError::Errno(libc::EIO))).unwrap().is_none());
    assert_eq!(ops.in_flight(), 1);
    let done = ops.segment_done(id.index, Err(SegmentError::Eof)).unwrap().expect("last segment");
    assert_eq!((done.id, done.ctx, done.error), (id, "get", Some(SegmentError::Errno(libc::EIO))), "the first error is kept");
    // A stray completion (no segment left) is reported, not a panic or an underflow.
    assert!(ops.segment_done(id.index, Ok(())).unwrap_err().contains("no segment in flight"));
    assert!(ops.segment_done(99, Ok(())).unwrap_err().contains("beyond the table"));
    assert_eq!(ops.with_context(id.index, |c| *c), None, "the context left with the last segment");
}

#[test]
fn wait_times_out_then_sees_the_outcome_until_release() {
    let ops = Arc::new(Table::new(1).unwrap());
    let id = ops.allocate(None).unwrap();
    ops.start(id, "get", 1).unwrap();
    assert!(!ops.is_done(id).unwrap());
    let t0 = Instant::now();
    assert!(ops.wait(id, Some(Duration::from_millis(30))).unwrap().is_none(), "time-out is Ok(None)");
    assert!(t0.elapsed() >= Duration::from_millis(30));
    let o = ops.clone();
    let completer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        o.segment_done(id.index, Ok(())).unwrap().unwrap();
        o.complete(id, Outcome::new(Status::Miss, 0, None, "absent"));
    });
    assert_eq!(ops.wait(id, None).unwrap().unwrap().status, Status::Miss);
    completer.join().unwrap();
    assert_eq!(ops.wait(id, Some(Duration::ZERO)).unwrap().unwrap().message, "absent", "repeated waits see the same outcome");
    ops.release(id);
    assert!(ops.wait(id, None).is_err(), "a released handle is stale");
    assert!(ops.allocate(Some(Duration::ZERO)).is_ok(), "release freed the entry");
}

#[test]
fn a_released_handle_frees_its_entry_on_completion_and_wakes_a_waiter() {
    let ops = Arc::new(Table::new(1).unwrap());
    let id = ops.allocate(None).unwrap();
    ops.start(id, "put", 1).unwrap();
    ops.release(id); // detached: still in flight
    assert_eq!(ops.in_flight(), 1);
    assert!(matches!(ops.allocate(Some(Duration::from_millis(20))), Err(EngineError::QueueFull { max_inflight: 1, .. })));
    let o = ops.clone();
    let waiter = std::thread::spawn(move || o.allocate(Some(Duration::from_secs(30))));
    std::thread::sleep(Duration::from_millis(50));
    ops.segment_done(id.index, Ok(())).unwrap().unwrap();
    ops.complete(id, ok());
    let next = waiter.join().unwrap().expect("the completion freed the entry");
    assert_eq!(next.index, id.index);
    assert_ne!(next.generation, id.generation);
    assert!(ops.is_done(id).is_err(), "the old handle is stale");
}

#[test]
fn an_abandoned_operation_answers_at_once_and_frees_only_when_its_work_ends() {
    let ops = Table::new(1).unwrap();
    let id = ops.allocate(None).unwrap();
    let since = Instant::now();
    ops.watch(id, Watch { root: 0, slot: 3, put: false, since, ready_gen: 0, background: false });
    ops.start(id, "get", 1).unwrap();
    let mut out = Vec::new();
    ops.abandon_overdue(|w| w.since <= Instant::now(), |_| Outcome::new(Status::Miss, 0, Some(libc::ETIMEDOUT), "timed out"), &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].watch.slot, 3);
    let o = ops.wait(id, Some(Duration::ZERO)).unwrap().expect("the caller has its outcome");
    assert_eq!((o.status, o.errno), (Status::Miss, Some(libc::ETIMEDOUT)));
    assert!(ops.is_abandoned(id) && ops.stuck() == 1);
    assert!(ops.is_done(id).unwrap() && !ops.is_settled(id), "answered, but the kernel may still move bytes");
    ops.abandon_overdue(|_| true, |_| unreachable!("abandoned once"), &mut out);
    assert!(out.is_empty());
    ops.release(id); // the handle is gone, the kernel is not done: still busy
    assert!(!ops.is_settled(id), "released by its handle, still not settled");
    assert!(ops.allocate(Some(Duration::ZERO)).is_err());
    assert!(!ops.drain(Some(Instant::now() + Duration::from_millis(20))), "close gives up on stuck work");
    let done = ops.segment_done(id.index, Ok(())).unwrap().unwrap();
    ops.complete(done.id, ok());
    assert_eq!(ops.stuck(), 0);
    assert!(ops.is_settled(id), "its work ended");
    assert!(ops.drain(Some(Instant::now())));
    assert!(ops.allocate(Some(Duration::ZERO)).is_ok(), "freed when its work ended");
    assert!(ops.is_settled(id), "its entry reused: the old id stays settled");
}

#[test]
fn completions_signal_the_eventfd() {
    let ops = Table::new(1).unwrap();
    let id = ops.allocate(None).unwrap();
    ops.start(id, "get", 1).unwrap();
    let mut n: u64 = 0;
    // SAFETY: reads at most 8 bytes into `n`, a live, writable u64.
    let read = |n: &mut u64| unsafe { libc::read(ops.event_fd(), n as *mut u64 as *mut _, 8) };
    assert_eq!(read(&mut n), -1, "nothing completed yet (non-blocking)");
    ops.segment_done(id.index, Ok(())).unwrap().unwrap();
    ops.complete(id, ok());
    assert_eq!(read(&mut n), 8);
    assert_eq!(n, 1);
}

#[test]
fn a_background_operation_is_promoted_once_before_or_after_its_start() {
    let ops = Table::new(3).unwrap();
    let watch = |background| Watch { root: 0, slot: 0, put: false, since: Instant::now(), ready_gen: 0, background };
    // Queued on its directory worker: it will start as demand work.
    let queued = ops.allocate(None).unwrap();
    ops.watch(queued, watch(true));
    assert_eq!(ops.promote(queued), Promotion::BeforeStart);
    assert_eq!(ops.promote(queued), Promotion::No, "once");
    assert_eq!(ops.start(queued, "prefetch", 1), Ok(true));
    assert!(ops.is_promoted(queued));
    // Handed to the backend: the caller moves what is still queued there.
    let started = ops.allocate(None).unwrap();
    ops.watch(started, watch(true));
    assert_eq!(ops.start(started, "prefetch", 1), Ok(false));
    assert_eq!(ops.promote(started), Promotion::Started);
    // A demand operation, and a finished one, have nothing to promote.
    let demand = ops.allocate(None).unwrap();
    ops.watch(demand, watch(false));
    assert_eq!(ops.promote(demand), Promotion::No);
    let done = ops.segment_done(queued.index, Ok(())).unwrap().unwrap();
    ops.complete(done.id, ok());
    ops.release(queued);
    assert!(!ops.is_promoted(queued), "freed: a stale handle");
    assert_eq!(ops.promote(queued), Promotion::No);
}
