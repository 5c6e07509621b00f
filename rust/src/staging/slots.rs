//! The slot table of a pool: which slots are free, which leased, and what
//! holds each leased one (views exported to Python, the store's I/O, a
//! quarantine). Bookkeeping only, under the pool's mutex; the pool owns the
//! memory. Slot numbers are checked against the pool by the caller.
//!
//! Invariants (`check`, after every change in debug builds; the tests):
//! - a slot is leased at most once: the free list holds no slot twice and no
//!   leased one, and (the creator's table) every slot is leased or free;
//! - counts never go below zero: ending a view or an I/O that never began is
//!   a bug of this crate, asserted (the ring thread's path reports it instead);
//! - only a leased slot is released (`release` refuses others: the caller's
//!   error); views and I/O are only on leased slots (the creator's table),
//!   and none begins on a slot its owner released, even one not free yet;
//! - a slot has at most one I/O; a quarantined slot has its I/O still
//!   pinned; a deferred release is of a leased, quarantined slot.

use crate::error::{EngineError, Result};

pub(super) struct SlotTable {
    /// The creator's table: leases are accounted here. An attached pool's
    /// table only counts views (its slots are leased by another process).
    owner: bool,
    free: Vec<u32>,
    acquired: Vec<bool>,
    exports: Vec<u32>,
    io_pins: Vec<u32>,
    /// The I/O pinning the slot was abandoned (past its deadline) while the
    /// kernel may still move bytes into or out of it: the slot is never
    /// handed out again until that I/O really ends (`unpin_io`).
    quarantined: Vec<bool>,
    /// Released by its owner while quarantined: freed by the final `unpin_io`.
    release_pending: Vec<bool>,
    pub quarantine_releases: u64,
    pub closed: bool,
}

/// What `release` did with a slot.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Released {
    /// Free again: a waiter may take it.
    Freed,
    /// Its abandoned I/O may still run: freed when that ends.
    Deferred,
}

impl SlotTable {
    pub fn new(num_slots: usize, owner: bool) -> Self {
        // Hand out low slots first so a lightly used pool touches little memory.
        let free = if owner { (0..num_slots as u32).rev().collect() } else { Vec::new() };
        SlotTable {
            owner,
            free,
            acquired: vec![false; num_slots],
            exports: vec![0; num_slots],
            io_pins: vec![0; num_slots],
            quarantined: vec![false; num_slots],
            release_pending: vec![false; num_slots],
            quarantine_releases: 0,
            closed: false,
        }
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Leased and not released: the owner's to use. A slot released while
    /// quarantined is no longer its owner's, though not free yet.
    pub fn is_acquired(&self, slot: usize) -> bool {
        self.acquired[slot] && !self.release_pending[slot]
    }

    pub fn exports(&self, slot: usize) -> u32 {
        self.exports[slot]
    }

    pub fn quarantined_count(&self) -> usize {
        self.quarantined.iter().filter(|&&q| q).count()
    }

    pub fn deferred_count(&self) -> usize {
        self.release_pending.iter().filter(|&&p| p).count()
    }

    pub fn first_exported(&self) -> Option<usize> {
        self.exports.iter().position(|&e| e > 0)
    }

    /// Leases the next free slot; None when none is free.
    pub fn lease(&mut self) -> Option<usize> {
        let slot = *self.free.last()? as usize;
        assert!(!self.acquired[slot], "slot {slot} is on the free list while leased");
        self.free.pop();
        self.acquired[slot] = true;
        self.debug_check();
        Some(slot)
    }

    pub fn release(&mut self, slot: usize) -> Result<Released> {
        if !self.is_acquired(slot) {
            return Err(EngineError::State(format!("slot {slot} is not acquired")));
        }
        if self.exports[slot] > 0 {
            return Err(EngineError::State(format!("slot {slot} still has {} exported view(s); release them first", self.exports[slot])));
        }
        if self.io_pins[slot] > 0 && self.quarantined[slot] {
            // Its I/O was abandoned: the owner is done with it, the kernel may
            // not be. Freed when that I/O ends, never before.
            self.release_pending[slot] = true;
            self.debug_check();
            return Ok(Released::Deferred);
        }
        if self.io_pins[slot] > 0 {
            return Err(EngineError::State(format!("slot {slot} has I/O in flight")));
        }
        self.free_slot(slot);
        Ok(Released::Freed)
    }

    /// A leased slot nothing holds any more goes back to the free list.
    fn free_slot(&mut self, slot: usize) {
        assert!(self.acquired[slot], "freeing slot {slot}, which is not leased");
        assert!(self.io_pins[slot] == 0 && self.exports[slot] == 0, "freeing slot {slot} while it is in use");
        self.acquired[slot] = false;
        self.free.push(slot as u32);
        self.debug_check();
    }

    pub fn export_begin(&mut self, slot: usize) -> Result<()> {
        if self.owner && !self.is_acquired(slot) {
            return Err(EngineError::State(format!("slot {slot} is not acquired")));
        }
        self.exports[slot] += 1;
        Ok(())
    }

    /// Ends a view `export_begin` counted (CPython pairs them).
    pub fn export_end(&mut self, slot: usize) {
        assert!(self.exports[slot] > 0, "view of slot {slot} ended, none was exported");
        self.exports[slot] -= 1;
    }

    pub fn pin_io(&mut self, slot: usize) -> Result<()> {
        if self.owner && !self.is_acquired(slot) {
            return Err(EngineError::State(format!("slot {slot} is not acquired")));
        }
        if self.io_pins[slot] > 0 {
            return Err(EngineError::State(format!("slot {slot} already has I/O in flight")));
        }
        self.io_pins[slot] = 1;
        self.debug_check();
        Ok(())
    }

    /// Ends the I/O `pin_io` began; Ok(true) when that freed the slot (its
    /// owner had released it while quarantined). Err, changing nothing, when
    /// the slot has no I/O: a bug of the caller, which runs on the ring thread
    /// (no panic there) and reports it.
    pub fn unpin_io(&mut self, slot: usize) -> std::result::Result<bool, String> {
        if self.io_pins[slot] == 0 {
            return Err(format!("I/O on staging slot {slot} ended, none was pinned"));
        }
        self.io_pins[slot] -= 1;
        let mut freed = false;
        if self.io_pins[slot] == 0 && self.quarantined[slot] {
            self.quarantined[slot] = false;
            self.quarantine_releases += 1;
            if std::mem::take(&mut self.release_pending[slot]) {
                self.free_slot(slot);
                freed = true;
            }
        }
        self.debug_check();
        Ok(freed)
    }

    /// Quarantines the slot if its I/O still runs.
    pub fn quarantine(&mut self, slot: usize) {
        if self.io_pins[slot] > 0 {
            self.quarantined[slot] = true;
        }
    }

    fn debug_check(&self) {
        debug_assert_eq!(self.check(), Ok(()));
    }

    /// All invariants (see the module docs); O(slots).
    pub fn check(&self) -> std::result::Result<(), String> {
        let n = self.acquired.len();
        let mut listed = vec![false; n];
        for &s in &self.free {
            let s = s as usize;
            match listed.get_mut(s) {
                None => return Err(format!("free slot {s} beyond the {n} slots")),
                Some(true) => return Err(format!("slot {s} listed free twice")),
                Some(seen) => *seen = true,
            }
            if self.acquired[s] {
                return Err(format!("slot {s} listed free while leased"));
            }
        }
        for (s, &free) in listed.iter().enumerate() {
            if self.owner && !self.acquired[s] && !free {
                return Err(format!("slot {s} neither leased nor free"));
            }
            if self.owner && !self.acquired[s] && (self.exports[s] > 0 || self.io_pins[s] > 0) {
                return Err(format!("slot {s} viewed or in I/O while not leased"));
            }
            if self.io_pins[s] > 1 {
                return Err(format!("slot {s} has {} I/O pinned at once", self.io_pins[s]));
            }
            if self.quarantined[s] && self.io_pins[s] == 0 {
                return Err(format!("slot {s} quarantined with no I/O"));
            }
            if self.release_pending[s] && !(self.quarantined[s] && self.acquired[s]) {
                return Err(format!("slot {s} release deferred while not leased and quarantined"));
            }
            if self.release_pending[s] && self.exports[s] > 0 {
                return Err(format!("slot {s} viewed after its owner released it"));
            }
        }
        if !self.owner && (!self.free.is_empty() || self.acquired.iter().any(|&a| a)) {
            return Err("an attached pool's table accounts leases".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Step {
        Lease,
        Release(usize),
        ExportBegin(usize),
        ExportEnd(usize),
        PinIo(usize),
        UnpinIo(usize),
        Quarantine(usize),
    }

    fn step(slots: usize) -> impl Strategy<Value = Step> {
        prop_oneof![
            Just(Step::Lease),
            (0..slots).prop_map(Step::Release),
            (0..slots).prop_map(Step::ExportBegin),
            (0..slots).prop_map(Step::ExportEnd),
            (0..slots).prop_map(Step::PinIo),
            (0..slots).prop_map(Step::UnpinIo),
            (0..slots).prop_map(Step::Quarantine),
        ]
    }

    proptest! {
        /// Whatever the store and Python do, in any order (ending only views
        /// that began: CPython pairs them), the table keeps its invariants and
        /// never leases a slot twice.
        #[test]
        fn any_sequence_keeps_the_invariants(steps in proptest::collection::vec(step(4), 0..200)) {
            let mut t = SlotTable::new(4, true);
            let mut leased = [false; 4];
            for s in steps {
                match s {
                    Step::Lease => {
                        if let Some(slot) = t.lease() {
                            prop_assert!(!leased[slot], "slot {} leased twice", slot);
                            leased[slot] = true;
                        }
                    }
                    Step::Release(slot) => {
                        if matches!(t.release(slot), Ok(Released::Freed)) {
                            leased[slot] = false;
                        }
                    }
                    Step::ExportBegin(slot) => { let _ = t.export_begin(slot); }
                    Step::ExportEnd(slot) if t.exports(slot) > 0 => t.export_end(slot),
                    Step::ExportEnd(_) => {}
                    Step::PinIo(slot) => { let _ = t.pin_io(slot); }
                    Step::UnpinIo(slot) => {
                        if t.unpin_io(slot) == Ok(true) {
                            leased[slot] = false;
                        }
                    }
                    Step::Quarantine(slot) => t.quarantine(slot),
                }
                prop_assert_eq!(t.check(), Ok(()));
                prop_assert_eq!(t.free_count() + leased.iter().filter(|&&l| l).count(), 4);
            }
        }
    }

    #[test]
    fn an_io_that_never_began_is_an_error_that_changes_nothing() {
        let mut t = SlotTable::new(2, true);
        let s = t.lease().unwrap();
        assert!(t.unpin_io(s).unwrap_err().contains("none was pinned"));
        t.pin_io(s).unwrap();
        assert_eq!(t.unpin_io(s), Ok(false));
        assert!(t.unpin_io(s).is_err(), "an I/O ends once");
        assert_eq!(t.check(), Ok(()));
    }

    #[test]
    #[should_panic(expected = "none was exported")]
    fn a_view_that_never_began_cannot_end() {
        let mut t = SlotTable::new(1, true);
        let s = t.lease().unwrap();
        t.export_end(s);
    }

    #[test]
    fn check_finds_what_the_table_must_never_hold() {
        let mut t = SlotTable::new(3, true);
        let s = t.lease().unwrap();
        t.free.push(s as u32);
        assert!(t.check().unwrap_err().contains("free while leased"));
        t.free.pop();
        t.free.push(t.free[0]);
        assert!(t.check().unwrap_err().contains("twice"));
        t.free.pop();
        t.free.pop();
        assert!(t.check().unwrap_err().contains("neither leased nor free"));
        let mut t = SlotTable::new(2, true);
        let s = t.lease().unwrap();
        t.quarantined[s] = true;
        assert!(t.check().unwrap_err().contains("quarantined with no I/O"));
    }
}
