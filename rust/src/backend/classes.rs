//! Two service classes for queued transfers: demand (get/put) and background
//! (prefetch). Demand work is always taken first, and background work never
//! holds more than `background_cap` of the backend's in-flight places, so a
//! demand read submitted behind a long prefetch burst starts at once instead
//! of waiting for the burst to drain.
//!
//! Two more bounds on background work (decision 0061): a byte budget on what
//! it has in flight, settable at run time (`set_background_budget`; none
//! until set), so that the device time a demand read waits behind preloads
//! stays near a target; and `promote`, which moves an operation's queued
//! background transfers to the back of the demand queue (its caller needs
//! the prefetch now).

use std::collections::VecDeque;

/// What the queue needs to know of a queued transfer.
pub trait Queued {
    fn background(&self) -> bool;
    /// Now a demand transfer (promoted before it started).
    fn make_demand(&mut self);
    /// The operation (op-table index) it belongs to.
    fn op(&self) -> u32;
    /// Bytes it moves when started (what it holds of the byte budget in flight).
    fn bytes(&self) -> usize;
}

pub struct ClassQueue<T> {
    demand: VecDeque<T>,
    background: VecDeque<T>,
    background_in_flight: usize,
    background_bytes_in_flight: usize,
    background_cap: usize,
    /// Background bytes in flight at most (one transfer always may, whatever
    /// its size); None: only the count cap.
    background_budget: Option<usize>,
}

impl<T: Queued> ClassQueue<T> {
    pub fn new(capacity: usize, background_cap: usize) -> Self {
        ClassQueue {
            demand: VecDeque::with_capacity(capacity),
            background: VecDeque::with_capacity(capacity),
            background_in_flight: 0,
            background_bytes_in_flight: 0,
            background_cap: background_cap.max(1),
            background_budget: None,
        }
    }

    pub fn push_back(&mut self, item: T) {
        let background = item.background();
        self.queue(background).push_back(item);
    }

    /// Ahead of newer work of its class (the remainder of a short transfer).
    pub fn push_front(&mut self, item: T) {
        let background = item.background();
        self.queue(background).push_front(item);
    }

    /// Next item to start: demand first, then background while under its
    /// cap and byte budget. A background item taken counts as in flight
    /// until `finished` (with its `bytes()` as they were when taken).
    pub fn pop(&mut self) -> Option<T> {
        if let Some(item) = self.demand.pop_front() {
            return Some(item);
        }
        if self.background_in_flight >= self.background_cap {
            return None;
        }
        let bytes = self.background.front()?.bytes();
        if let Some(budget) = self.background_budget {
            if self.background_in_flight > 0 && self.background_bytes_in_flight + bytes > budget {
                return None;
            }
        }
        let item = self.background.pop_front()?;
        self.background_in_flight += 1;
        self.background_bytes_in_flight += bytes;
        Some(item)
    }

    /// Undoes a `pop` whose item could not be started after all.
    pub fn unpop(&mut self, item: T) {
        self.finished(&item);
        self.push_front(item);
    }

    /// An item taken by `pop` completed (or was requeued). Its `bytes()`
    /// must be what they were when it was taken.
    pub fn finished(&mut self, item: &T) {
        if item.background() {
            // Called by the ring thread, which must not panic: checked in debug builds.
            debug_assert!(self.background_in_flight > 0, "a background transfer finished twice");
            debug_assert!(self.background_bytes_in_flight >= item.bytes(), "a background transfer's bytes changed in flight");
            self.background_in_flight = self.background_in_flight.saturating_sub(1);
            self.background_bytes_in_flight = self.background_bytes_in_flight.saturating_sub(item.bytes());
        }
    }

    /// Moves the queued background items of operation `op` to the back of
    /// the demand queue, in their order; returns how many moved (0: none
    /// queued, i.e. all started already, or not a background operation).
    pub fn promote(&mut self, op: u32) -> usize {
        let mut moved = 0;
        let mut i = 0;
        // An operation has few segments: removal by index is cheap enough,
        // and the queue keeps its allocation.
        while i < self.background.len() {
            if self.background[i].op() != op {
                i += 1;
                continue;
            }
            if let Some(mut item) = self.background.remove(i) {
                item.make_demand();
                self.demand.push_back(item);
                moved += 1;
            }
        }
        moved
    }

    /// Background bytes in flight at most from now on (None: no byte bound,
    /// the count cap only). Lowering it starts nothing new until enough
    /// ends; work in flight is never recalled.
    pub fn set_background_budget(&mut self, bytes: Option<usize>) {
        self.background_budget = bytes;
    }

    fn queue(&mut self, background: bool) -> &mut VecDeque<T> {
        if background {
            &mut self.background
        } else {
            &mut self.demand
        }
    }

    pub fn is_empty(&self) -> bool {
        self.demand.is_empty() && self.background.is_empty()
    }

    /// Everything queued, of both classes, whatever the cap (the backend
    /// failed and fails it all).
    pub fn take_all(&mut self) -> impl Iterator<Item = T> + '_ {
        self.demand.drain(..).chain(self.background.drain(..))
    }
}

#[cfg(test)]
mod tests {
    use super::{ClassQueue, Queued};

    /// (id, op, bytes, background)
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct T(u32, u32, usize, bool);

    impl Queued for T {
        fn background(&self) -> bool {
            self.3
        }
        fn make_demand(&mut self) {
            self.3 = false;
        }
        fn op(&self) -> u32 {
            self.1
        }
        fn bytes(&self) -> usize {
            self.2
        }
    }

    fn bg(id: u32) -> T {
        T(id, id, 100, true)
    }

    fn demand(id: u32) -> T {
        T(id, id, 100, false)
    }

    #[test]
    fn demand_overtakes_queued_background_work() {
        let mut q = ClassQueue::new(8, 1);
        for i in 0..4 {
            q.push_back(bg(i));
        }
        q.push_back(demand(100));
        assert_eq!(q.pop(), Some(demand(100)));
        let first = q.pop().unwrap();
        assert_eq!(first, bg(0));
        // The background cap (1) is reached: nothing more until it finishes.
        assert_eq!(q.pop(), None);
        q.push_back(demand(101));
        assert_eq!(q.pop(), Some(demand(101)));
        q.finished(&first);
        assert_eq!(q.pop(), Some(bg(1)));
    }

    #[test]
    fn unpop_restores_order_and_count() {
        let mut q = ClassQueue::new(4, 1);
        q.push_back(bg(1));
        q.push_back(bg(2));
        let item = q.pop().unwrap();
        q.unpop(item);
        let item = q.pop().unwrap();
        assert_eq!(item, bg(1));
        q.finished(&item);
        let item = q.pop().unwrap();
        assert_eq!(item, bg(2));
        q.finished(&item);
        assert!(q.is_empty());
    }

    #[test]
    fn promotion_moves_an_operations_queued_transfers_to_demand() {
        let mut q = ClassQueue::new(8, 1);
        // Operation 7 has two segments, queued behind other prefetches.
        for item in [bg(1), T(10, 7, 100, true), bg(2), T(11, 7, 50, true), bg(3)] {
            q.push_back(item);
        }
        q.push_back(demand(100));
        assert_eq!(q.promote(7), 2);
        // Nothing left to move: its transfers are demand ones now.
        assert_eq!(q.promote(7), 0);
        assert_eq!(q.promote(42), 0);
        assert_eq!(q.pop(), Some(demand(100)));
        // Behind the demand work queued before the promotion, in their order.
        assert_eq!(q.pop(), Some(T(10, 7, 100, false)));
        assert_eq!(q.pop(), Some(T(11, 7, 50, false)));
        // Promoted ones never counted against the background cap.
        let first = q.pop().unwrap();
        assert_eq!(first, bg(1));
        assert_eq!(q.pop(), None);
        q.finished(&T(10, 7, 100, false));
        assert_eq!(q.pop(), None, "a promoted transfer ending frees no background place");
        q.finished(&first);
        assert_eq!(q.pop(), Some(bg(2)));
    }

    #[test]
    fn promotion_of_a_started_transfer_moves_nothing() {
        let mut q = ClassQueue::new(4, 2);
        q.push_back(bg(5));
        let started = q.pop().unwrap();
        assert_eq!(q.promote(5), 0);
        q.finished(&started);
        assert!(q.is_empty());
    }

    #[test]
    fn byte_budget_bounds_background_bytes_in_flight() {
        let mut q = ClassQueue::new(16, 8);
        for i in 0..6 {
            q.push_back(T(i, i, 100, true));
        }
        q.set_background_budget(Some(250));
        let a = q.pop().unwrap();
        let b = q.pop().unwrap();
        // 200 in flight: a third would be 300 > 250, although the count cap (8) allows it.
        assert_eq!(q.pop(), None);
        // Demand work is never held back by the budget.
        q.push_back(demand(100));
        assert_eq!(q.pop(), Some(demand(100)));
        q.finished(&a);
        assert_eq!(q.pop(), Some(T(2, 2, 100, true)));
        assert_eq!(q.pop(), None);
        // Raised at run time: more may start at once.
        q.set_background_budget(Some(400));
        assert_eq!(q.pop(), Some(T(3, 3, 100, true)));
        assert_eq!(q.pop(), Some(T(4, 4, 100, true)));
        assert_eq!(q.pop(), None);
        // Removed: only the count cap (8) bounds it.
        q.set_background_budget(None);
        assert_eq!(q.pop(), Some(T(5, 5, 100, true)));
        q.finished(&b);
    }

    #[test]
    fn a_transfer_larger_than_the_budget_still_starts_alone() {
        let mut q = ClassQueue::new(4, 4);
        q.push_back(T(1, 1, 1000, true));
        q.push_back(T(2, 2, 1000, true));
        q.set_background_budget(Some(10));
        let first = q.pop().unwrap();
        assert_eq!(first, T(1, 1, 1000, true));
        assert_eq!(q.pop(), None);
        q.finished(&first);
        assert_eq!(q.pop(), Some(T(2, 2, 1000, true)));
    }

    #[test]
    fn budget_counts_the_bytes_each_transfer_had_when_taken() {
        let mut q = ClassQueue::new(4, 4);
        q.push_back(T(1, 1, 60, true));
        q.push_back(T(2, 2, 60, true));
        q.push_back(T(3, 3, 60, true));
        q.set_background_budget(Some(120));
        let a = q.pop().unwrap();
        let b = q.pop().unwrap();
        assert_eq!(q.pop(), None);
        q.finished(&a);
        q.finished(&b);
        // Back to 0 bytes in flight: exactly what fits starts again.
        assert_eq!(q.pop(), Some(T(3, 3, 60, true)));
    }
}
