//! Two service classes for queued transfers: demand (get/put) and background
//! (prefetch). Demand work is always taken first, and background work never
//! holds more than `background_cap` of the backend's in-flight places, so a
//! demand read submitted behind a long prefetch burst starts at once instead
//! of waiting for the burst to drain.

use std::collections::VecDeque;

pub struct ClassQueue<T> {
    demand: VecDeque<T>,
    background: VecDeque<T>,
    background_in_flight: usize,
    background_cap: usize,
}

impl<T> ClassQueue<T> {
    pub fn new(capacity: usize, background_cap: usize) -> Self {
        ClassQueue {
            demand: VecDeque::with_capacity(capacity),
            background: VecDeque::with_capacity(capacity),
            background_in_flight: 0,
            background_cap: background_cap.max(1),
        }
    }

    pub fn push_back(&mut self, item: T, background: bool) {
        self.queue(background).push_back(item);
    }

    /// Ahead of newer work of its class (the remainder of a short transfer).
    pub fn push_front(&mut self, item: T, background: bool) {
        self.queue(background).push_front(item);
    }

    /// Next item to start: demand first, then background while under its cap.
    /// A background item taken counts as in flight until `finished(true)`.
    pub fn pop(&mut self) -> Option<(T, bool)> {
        if let Some(item) = self.demand.pop_front() {
            return Some((item, false));
        }
        if self.background_in_flight < self.background_cap {
            if let Some(item) = self.background.pop_front() {
                self.background_in_flight += 1;
                return Some((item, true));
            }
        }
        None
    }

    /// Undoes a `pop` whose item could not be started after all.
    pub fn unpop(&mut self, item: T, background: bool) {
        if background {
            self.background_in_flight -= 1;
        }
        self.push_front(item, background);
    }

    /// An item taken by `pop` completed (or was requeued).
    pub fn finished(&mut self, background: bool) {
        if background {
            self.background_in_flight -= 1;
        }
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
    use super::ClassQueue;

    #[test]
    fn demand_overtakes_queued_background_work() {
        let mut q = ClassQueue::new(8, 1);
        for i in 0..4 {
            q.push_back(i, true);
        }
        q.push_back(100, false);
        assert_eq!(q.pop(), Some((100, false)));
        assert_eq!(q.pop(), Some((0, true)));
        // The background cap (1) is reached: nothing more until it finishes.
        assert_eq!(q.pop(), None);
        q.push_back(101, false);
        assert_eq!(q.pop(), Some((101, false)));
        q.finished(true);
        assert_eq!(q.pop(), Some((1, true)));
    }

    #[test]
    fn unpop_restores_order_and_count() {
        let mut q = ClassQueue::new(4, 1);
        q.push_back(1, true);
        q.push_back(2, true);
        let (item, bg) = q.pop().unwrap();
        q.unpop(item, bg);
        assert_eq!(q.pop(), Some((1, true)));
        q.finished(true);
        assert_eq!(q.pop(), Some((2, true)));
        q.finished(true);
        assert!(q.is_empty());
    }
}
