//! In-memory index of the chunks present on disk, in LRU order, with the
//! byte accounting that enforces the capacity limit.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

/// The most evicted chunks remembered for `take_removed` (older ones are dropped, counted).
pub const REMOVED_LOG_MAX: usize = 1 << 16;

#[derive(Clone, Copy, Debug)]
struct Entry {
    file_len: u64,
    tick: u64,
}

/// A chunk file found on disk by a scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub hash: u128,
    pub file_len: u64,
    /// Written by `preformat` to be overwritten (see `ChunkIndex::demote_filler`).
    pub filler: bool,
}

pub struct ChunkIndex {
    entries: HashMap<u128, Entry>,
    /// Filler chunks: allocated, fully written files that only hold space
    /// for the first puts to overwrite; always least recently used.
    fillers: HashSet<u128>,
    lru: BTreeMap<u64, u128>,
    /// Ticks start in the middle of the range: new entries count up, chunks
    /// a background scan found count down (older than anything indexed).
    next_tick: u64,
    low_tick: u64,
    used: u64,
    /// While a background scan runs: chunks removed meanwhile, which the scan
    /// may have seen before they went and must not bring back.
    removed_during_scan: Option<HashSet<u128>>,
    /// Real chunks (not fillers) that left the index, oldest first, for the
    /// caller to announce (vLLM's KV events); bounded, overflow counted.
    removed_log: VecDeque<u128>,
    removed_log_dropped: u64,
}

const MID_TICK: u64 = 1 << 63;

impl Default for ChunkIndex {
    fn default() -> Self {
        ChunkIndex {
            entries: HashMap::new(),
            fillers: HashSet::new(),
            lru: BTreeMap::new(),
            next_tick: MID_TICK,
            low_tick: MID_TICK,
            used: 0,
            removed_during_scan: None,
            removed_log: VecDeque::new(),
            removed_log_dropped: 0,
        }
    }
}

impl ChunkIndex {
    /// A background scan starts: removals are remembered until `merge_scanned`.
    pub fn begin_scan(&mut self) {
        self.removed_during_scan = Some(HashSet::new());
    }

    #[cfg(test)]
    pub fn scanning(&self) -> bool {
        self.removed_during_scan.is_some()
    }

    /// Adds what a background scan found (oldest first) as less recently used
    /// than every chunk indexed meanwhile; skips chunks indexed or removed
    /// since the scan started (the live view is newer). Returns how many were added.
    pub fn merge_scanned(&mut self, found: &[Found]) -> usize {
        let removed = self.removed_during_scan.take().unwrap_or_default();
        let mut added = 0;
        for f in found.iter().rev() {
            if self.entries.contains_key(&f.hash) || removed.contains(&f.hash) {
                continue;
            }
            self.insert_oldest(f.hash, f.file_len);
            if f.filler {
                self.fillers.insert(f.hash);
            }
            added += 1;
        }
        added
    }

    fn insert_oldest(&mut self, hash: u128, file_len: u64) {
        self.low_tick -= 1;
        let tick = self.low_tick;
        self.entries.insert(hash, Entry { file_len, tick });
        self.lru.insert(tick, hash);
        self.used += file_len;
    }

    /// Makes an indexed chunk a filler: least recently used of all, so the
    /// next put that needs room overwrites it (recycling its allocated file)
    /// before any real chunk is evicted.
    pub fn demote_filler(&mut self, hash: u128) -> bool {
        let Some(len) = self.remove_entry(hash) else { return false };
        self.insert_oldest(hash, len);
        self.fillers.insert(hash);
        true
    }

    pub fn filler_count(&self) -> usize {
        self.fillers.len()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn contains(&self, hash: u128) -> bool {
        self.entries.contains_key(&hash)
    }

    pub fn file_len(&self, hash: u128) -> Option<u64> {
        self.entries.get(&hash).map(|e| e.file_len)
    }

    /// Inserts or refreshes a chunk as most recently used.
    pub fn insert(&mut self, hash: u128, file_len: u64) {
        self.remove_entry(hash);
        let tick = self.bump();
        self.entries.insert(hash, Entry { file_len, tick });
        self.lru.insert(tick, hash);
        self.used += file_len;
    }

    pub fn touch(&mut self, hash: u128) {
        if let Some(e) = self.entries.get(&hash).copied() {
            self.lru.remove(&e.tick);
            let tick = self.bump();
            self.entries.insert(hash, Entry { tick, ..e });
            self.lru.insert(tick, hash);
        }
    }

    pub fn remove(&mut self, hash: u128) -> Option<u64> {
        if let Some(removed) = &mut self.removed_during_scan {
            removed.insert(hash);
        }
        let filler = self.fillers.contains(&hash);
        let len = self.remove_entry(hash)?;
        if !filler {
            if self.removed_log.len() >= REMOVED_LOG_MAX {
                self.removed_log.pop_front();
                self.removed_log_dropped += 1;
            }
            self.removed_log.push_back(hash);
        }
        Some(len)
    }

    /// Chunks removed since the last call (evicted, found vanished or
    /// corrupt), oldest first, and how many were dropped because the log was full.
    pub fn take_removed(&mut self) -> (Vec<u128>, u64) {
        (self.removed_log.drain(..).collect(), std::mem::take(&mut self.removed_log_dropped))
    }

    /// The tick of the most recent insert or touch: a `refresh` keeps
    /// entries newer than its start whatever its walk saw.
    pub fn last_tick(&self) -> u64 {
        self.next_tick
    }

    /// Brings the index in line with a walk of the directories (started at
    /// `since` = `last_tick()`, after `begin_scan`), for directories other
    /// processes or nodes write too: chunks the walk found that the index
    /// lacks are added as least recently used (this process never used them),
    /// unless removed meanwhile; entries the walk did not find are dropped
    /// (another node evicted them) unless inserted or touched since the walk
    /// began. Returns (added, dropped).
    pub fn refresh(&mut self, found: &[Found], since: u64) -> (usize, usize) {
        let present: HashSet<u128> = found.iter().map(|f| f.hash).collect();
        let gone: Vec<u128> = self.entries.iter().filter(|(h, e)| e.tick <= since && !present.contains(h)).map(|(h, _)| *h).collect();
        let added = self.merge_scanned(found);
        for h in &gone {
            self.remove(*h);
        }
        (added, gone.len())
    }

    fn remove_entry(&mut self, hash: u128) -> Option<u64> {
        self.fillers.remove(&hash);
        let e = self.entries.remove(&hash)?;
        self.lru.remove(&e.tick);
        self.used -= e.file_len;
        Some(e.file_len)
    }

    /// Least recently used chunks to drop so that `incoming` more bytes fit
    /// in `capacity`, skipping `keep`. Does not remove them.
    pub fn victims(&self, incoming: u64, capacity: u64, keep: u128) -> Vec<(u128, u64)> {
        let mut need = (self.used + incoming).saturating_sub(capacity);
        let mut out = Vec::new();
        for (_, &hash) in self.lru.iter() {
            if need == 0 {
                break;
            }
            if hash == keep {
                continue;
            }
            let len = self.entries[&hash].file_len;
            out.push((hash, len));
            need = need.saturating_sub(len);
        }
        out
    }

    /// Least recently used chunks matching `pick` whose bytes cover `need`,
    /// skipping `keep`. Does not remove them.
    pub fn victims_where(&self, mut need: u64, keep: u128, pick: impl Fn(u128) -> bool) -> Vec<(u128, u64)> {
        let mut out = Vec::new();
        for (_, &hash) in self.lru.iter() {
            if need == 0 {
                break;
            }
            if hash == keep || !pick(hash) {
                continue;
            }
            let len = self.entries[&hash].file_len;
            out.push((hash, len));
            need = need.saturating_sub(len);
        }
        out
    }

    fn bump(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_victims_cover_the_shortfall_oldest_first() {
        let mut ix = ChunkIndex::default();
        for h in 1..=4u128 {
            ix.insert(h, 100);
        }
        ix.touch(1);
        assert_eq!(ix.used_bytes(), 400);
        let v: Vec<u128> = ix.victims(150, 400, 0).into_iter().map(|(h, _)| h).collect();
        assert_eq!(v, vec![2, 3]);
        assert!(ix.victims(0, 400, 0).is_empty());
        ix.remove(2);
        assert_eq!(ix.used_bytes(), 300);
        ix.insert(3, 50);
        assert_eq!(ix.used_bytes(), 250, "re-insert replaces the old size");
    }

    #[test]
    fn a_background_scan_merges_as_least_recent_and_never_revives_removed_chunks() {
        let mut ix = ChunkIndex::default();
        ix.begin_scan();
        ix.insert(10, 100); // written while the scan ran
        ix.insert(11, 100);
        ix.remove(11); // ... and evicted again
        ix.remove(3); // an old chunk evicted (by path) before the scan reached the index
        let found: Vec<Found> = [1, 2, 3, 10, 11].map(|hash| Found { hash, file_len: 10, filler: false }).to_vec(); // oldest first
        assert_eq!(ix.merge_scanned(&found), 2);
        assert!(!ix.scanning());
        assert!(ix.contains(1) && ix.contains(2) && !ix.contains(3) && !ix.contains(11));
        assert_eq!(ix.file_len(10), Some(100), "the live entry wins");
        assert_eq!(ix.used_bytes(), 120);
        // LRU: scanned chunks oldest first, then what was written meanwhile.
        let order: Vec<u128> = ix.victims(1000, 0, 0).into_iter().map(|(h, _)| h).collect();
        assert_eq!(order, vec![1, 2, 10]);
        ix.remove(1);
        assert_eq!(ix.merge_scanned(&[Found { hash: 1, file_len: 10, filler: false }]), 1, "outside a scan nothing is remembered");
    }

    #[test]
    fn victims_where_picks_matching_chunks_oldest_first() {
        let mut ix = ChunkIndex::default();
        for h in 1..=6u128 {
            ix.insert(h, 100);
        }
        let even: Vec<u128> = ix.victims_where(150, 4, |h| h % 2 == 0).into_iter().map(|(h, _)| h).collect();
        assert_eq!(even, vec![2, 6], "skips odd keys and the kept one");
        assert!(ix.victims_where(0, 0, |_| true).is_empty());
        assert_eq!(ix.victims_where(10_000, 0, |h| h > 4).len(), 2, "at most what matches");
    }

    #[test]
    fn refresh_adds_what_others_wrote_and_drops_what_they_removed() {
        let mut ix = ChunkIndex::default();
        for h in 1..=3u128 {
            ix.insert(h, 100);
        }
        ix.begin_scan();
        let since = ix.last_tick();
        ix.insert(4, 100); // published here while the walk ran (the walk missed it)
                           // The walk: 1 and 3 still there, 2 gone (another node evicted it), 9 new (another node wrote it).
        let found: Vec<Found> = [1, 3, 9].map(|hash| Found { hash, file_len: 100, filler: false }).to_vec();
        assert_eq!(ix.refresh(&found, since), (1, 1));
        assert!(ix.contains(1) && !ix.contains(2) && ix.contains(3) && ix.contains(4) && ix.contains(9));
        assert_eq!(ix.used_bytes(), 400);
        assert_eq!(ix.victims(100, 400, 0)[0].0, 9, "a chunk this process never used goes first");
        let (removed, dropped) = ix.take_removed();
        assert_eq!((removed, dropped), (vec![2], 0));
        ix.insert(3, 100); // a re-insert is no removal
        ix.demote_filler(3);
        ix.remove(3); // nor is a filler leaving
        assert!(ix.take_removed().0.is_empty());
    }

    #[test]
    fn fillers_go_first_and_are_counted_until_replaced() {
        let mut ix = ChunkIndex::default();
        for h in 1..=4u128 {
            ix.insert(h, 100);
        }
        assert!(ix.demote_filler(3) && ix.demote_filler(4) && !ix.demote_filler(9));
        assert_eq!((ix.filler_count(), ix.used_bytes(), ix.len()), (2, 400, 4));
        let order: Vec<u128> = ix.victims(400, 400, 0).into_iter().map(|(h, _)| h).collect();
        assert_eq!(order, vec![4, 3, 1, 2], "fillers first (last demoted first), then LRU");
        ix.remove(4);
        ix.insert(3, 100); // the same key written for real
        assert_eq!(ix.filler_count(), 0);
        ix.merge_scanned(&[Found { hash: 7, file_len: 50, filler: true }]);
        assert_eq!(ix.filler_count(), 1);
    }
}
