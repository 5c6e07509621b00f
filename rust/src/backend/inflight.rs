//! The io_uring backend's table of transfers in flight: place `i` holds the
//! transfer whose submission carries token `i`, so a completion finds its
//! transfer at once and the ring never has more than `depth` in flight.
//!
//! Invariants, checked in full by `check` (debug builds, after every change;
//! the tests): every place is either free or holds one transfer, never both;
//! no place is listed free twice; so `in flight + free = depth`. And no two
//! transfers in flight share a byte of a staging slot: a slot is handed to
//! the kernel again only once the transfers into or out of it ended (the
//! segments of one operation are disjoint, and a slot has one operation at a
//! time). A caller's region is the caller's: two operations on one row are
//! its business, so region memory is not checked.
//!
//! The ring thread must not panic (a dead ring thread hangs every caller):
//! what it can get wrong cheaply, a completion whose token names no transfer
//! in flight, is a `None` it reports as an anomaly.

use super::Segment;

/// A segment on its way through the ring: `done` of its bytes moved so far.
pub(super) struct Pending {
    pub seg: Segment,
    pub done: usize,
}

pub(super) struct InFlight {
    places: Vec<Option<Pending>>,
    /// Places holding nothing; the next one taken is the last.
    free: Vec<usize>,
}

impl InFlight {
    pub fn new(depth: usize) -> Self {
        InFlight { places: (0..depth).map(|_| None).collect(), free: (0..depth).rev().collect() }
    }

    /// Transfers in flight (at most the depth).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.places.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.free.len() == self.places.len()
    }

    /// The place (token) the next `occupy` takes; None when the ring is full.
    pub fn next_free(&self) -> Option<usize> {
        self.free.last().copied()
    }

    /// Puts `p` in flight at `place`, which `next_free` just gave: its
    /// submission, carrying token `place`, was queued for the kernel.
    pub fn occupy(&mut self, place: usize, p: Pending) {
        let taken = self.free.pop();
        debug_assert_eq!(taken, Some(place), "a place taken out of turn");
        debug_assert!(self.places[place].is_none(), "place {place} was listed free while holding a transfer");
        debug_assert!(p.done < p.seg.len, "a transfer with nothing left to move");
        self.places[place] = Some(p);
        debug_assert_eq!(self.check(), Ok(()));
    }

    /// The transfer of token `token`, which completed (or failed with the
    /// ring); its place is free again. None: the token names no transfer in
    /// flight (for the caller to report; never a panic).
    pub fn complete(&mut self, token: u64) -> Option<Pending> {
        let place = usize::try_from(token).ok()?;
        let p = self.places.get_mut(place)?.take()?;
        self.free.push(place);
        debug_assert_eq!(self.check(), Ok(()));
        Some(p)
    }

    /// Every transfer still in flight, the table emptied.
    pub fn drain(&mut self) -> Vec<Pending> {
        let left: Vec<Pending> = self.places.iter_mut().filter_map(Option::take).collect();
        self.free = (0..self.places.len()).rev().collect();
        left
    }

    /// All invariants of the table (see the module docs); O(depth log depth).
    pub fn check(&self) -> Result<(), String> {
        let depth = self.places.len();
        let mut listed = vec![false; depth];
        for &place in &self.free {
            match listed.get_mut(place) {
                None => return Err(format!("free place {place} beyond the depth {depth}")),
                Some(true) => return Err(format!("place {place} listed free twice")),
                Some(seen) => *seen = true,
            }
            if self.places[place].is_some() {
                return Err(format!("place {place} listed free while holding a transfer"));
            }
        }
        let mut ranges: Vec<(usize, usize, u32)> = Vec::with_capacity(depth);
        for (place, p) in self.places.iter().enumerate() {
            let Some(p) = p else {
                if !listed[place] {
                    return Err(format!("place {place} neither free nor holding a transfer"));
                }
                continue;
            };
            if p.done >= p.seg.len {
                return Err(format!("place {place} holds a transfer with nothing left ({} of {} bytes)", p.done, p.seg.len));
            }
            if p.seg.buf_index.is_some() {
                ranges.push((p.seg.buf as usize, p.seg.buf as usize + p.seg.len, p.seg.op));
            }
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(format!("transfers of operations {} and {} in flight on the same staging bytes", w[0].2, w[1].2));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(op: u32, at: usize, len: usize) -> Pending {
        let seg = Segment {
            op,
            fd: -1,
            buf: at as *mut u8,
            len,
            offset: 0,
            file_base: 0,
            write: false,
            buf_index: Some(0),
            background: false,
            root: 0,
        };
        Pending { seg, done: 0 }
    }

    #[test]
    fn a_place_holds_one_transfer_until_its_completion() {
        let mut t = InFlight::new(2);
        let a = t.next_free().unwrap();
        t.occupy(a, pending(1, 4096, 4096));
        let b = t.next_free().unwrap();
        assert_ne!(a, b);
        t.occupy(b, pending(2, 8192, 4096));
        assert_eq!((t.len(), t.next_free()), (2, None), "never more in flight than the depth");
        assert_eq!(t.check(), Ok(()));
        assert_eq!(t.complete(a as u64).map(|p| p.seg.op), Some(1));
        assert!(t.complete(a as u64).is_none(), "a token completes once");
        assert!(t.complete(7).is_none() && t.complete(u64::MAX).is_none(), "tokens naming no place");
        assert_eq!((t.len(), t.next_free()), (1, Some(a)));
        assert_eq!(t.drain().len(), 1);
        assert!(t.is_empty());
        assert_eq!(t.check(), Ok(()));
    }

    #[test]
    fn check_finds_what_the_table_must_never_hold() {
        let mut t = InFlight::new(3);
        t.places[0] = Some(pending(1, 4096, 8192));
        assert!(t.check().unwrap_err().contains("listed free while holding"));
        t.free.retain(|&p| p != 0);
        assert_eq!(t.check(), Ok(()));
        t.places[1] = Some(pending(2, 8192, 4096));
        t.free.retain(|&p| p != 1);
        assert!(t.check().unwrap_err().contains("same staging bytes"), "a slot's bytes in flight twice");
        t.places[1].as_mut().unwrap().seg.buf_index = None;
        assert_eq!(t.check(), Ok(()), "a caller's region is not checked");
        t.places[1] = None;
        assert!(t.check().unwrap_err().contains("neither free"));
        t.free.extend([1, 1]);
        assert!(t.check().unwrap_err().contains("twice"));
    }
}
