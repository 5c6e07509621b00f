//! In-memory index of the chunks present on disk, in recency order, with the
//! byte accounting that enforces the capacity limit.
//!
//! It holds this store's namespace *and* the other namespaces found under its
//! storage roots (chunks of other models, dtypes, overrides, or of older
//! versions of this one): `capacity_bytes` bounds the directory, so their
//! bytes count and their stalest chunks are evicted like this store's
//! (decision 0053). Lookups (`contains`, `file_len`, `touch`, ...) only ever
//! see this store's namespace: another namespace's chunk is never a hit.
//!
//! Recency is a wall-clock time per chunk: its last use by this store (put,
//! get) when it used it since open, else its file's modification time (when
//! a writer, any process, last published it). Wall time, not a private
//! counter, because it must compare chunks this store used with chunks other
//! processes wrote: a chunk another writer published a second ago is fresher
//! than one this store read an hour ago. The modification time, not the
//! access time: `noatime`/`relatime` mounts (the default) do not keep atime,
//! and reads here use O_DIRECT. Ties (and clock steps) are broken by a tick.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::SystemTime;

/// The most evicted chunks remembered for `take_removed` (older ones are dropped, counted).
pub const REMOVED_LOG_MAX: usize = 1 << 16;

/// A namespace directory under the store's roots: `OWN` is the store's own
/// namespace; other ids are handed out by `Layout::other_namespace`.
pub type NsId = u32;
pub const OWN: NsId = 0;

/// A chunk of any namespace under the roots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkRef {
    pub ns: NsId,
    pub hash: u128,
}

impl ChunkRef {
    pub fn own(hash: u128) -> Self {
        ChunkRef { ns: OWN, hash }
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    file_len: u64,
    tick: u64,
    /// Last use, nanoseconds since the Unix epoch (0: a filler).
    used_at: u64,
}

/// A chunk file found on disk by a scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub ns: NsId,
    pub hash: u128,
    pub file_len: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub modified: u64,
    /// Written by `preformat` to be overwritten (see `ChunkIndex::demote_filler`).
    pub filler: bool,
}

/// Nanoseconds since the Unix epoch of `t` (0 before it).
pub fn epoch_ns(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_nanos().min(u64::MAX as u128) as u64).unwrap_or(0)
}

fn now_ns() -> u64 {
    // Never 0: that marks fillers.
    epoch_ns(SystemTime::now()).max(1)
}

pub struct ChunkIndex {
    entries: HashMap<ChunkRef, Entry>,
    /// Filler chunks (this namespace): allocated, fully written files that
    /// only hold space for the first puts to overwrite; always least recently used.
    fillers: HashSet<u128>,
    /// (last use, tick) -> chunk: eviction order, stalest first.
    lru: BTreeMap<(u64, u64), ChunkRef>,
    /// Ticks start in the middle of the range: new entries count up, chunks
    /// a scan found count down (so `refresh` can tell them apart).
    next_tick: u64,
    low_tick: u64,
    /// Chunks and bytes of each namespace.
    totals: HashMap<NsId, (u64, u64)>,
    total_bytes: u64,
    /// While a background scan runs: chunks removed meanwhile, which the scan
    /// may have seen before they went and must not bring back.
    removed_during_scan: Option<HashSet<ChunkRef>>,
    /// Real chunks of this namespace (not fillers) that left the index,
    /// oldest first, for the caller to announce (vLLM's KV events); bounded,
    /// overflow counted.
    removed_log: VecDeque<u128>,
    removed_log_dropped: u64,
    /// Chunks of this namespace this store is writing (room reserved, not yet
    /// inserted): a walk that finds one just published must not count it too,
    /// since its bytes are still reserved (they move to the index on insert).
    putting: HashMap<u128, u32>,
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
            totals: HashMap::new(),
            total_bytes: 0,
            removed_during_scan: None,
            removed_log: VecDeque::new(),
            removed_log_dropped: 0,
            putting: HashMap::new(),
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

    /// Adds what a scan found, ranked by its modification time (a chunk a
    /// scan finds was not used by this store since): skips chunks indexed or
    /// removed since the scan started (the live view is newer). Returns how
    /// many were added.
    pub fn merge_scanned(&mut self, found: &[Found]) -> usize {
        let removed = self.removed_during_scan.take().unwrap_or_default();
        let mut added = 0;
        for f in found.iter().rev() {
            let c = ChunkRef { ns: f.ns, hash: f.hash };
            if self.entries.contains_key(&c) || removed.contains(&c) || (f.ns == OWN && self.putting.contains_key(&f.hash)) {
                continue;
            }
            self.low_tick -= 1;
            let filler = f.filler && f.ns == OWN;
            self.add(c, Entry { file_len: f.file_len, tick: self.low_tick, used_at: if filler { 0 } else { f.modified } });
            if filler {
                self.fillers.insert(f.hash);
            }
            added += 1;
        }
        added
    }

    /// Adds chunks found outside a walk (other writers' segments, decision
    /// 0086), ranked by their modification time, unless indexed already or
    /// being put here. Their tick is a new one, like an insert's: a walk that
    /// began before must not take them for gone. Returns how many were added.
    pub fn add_found(&mut self, found: &[Found]) -> usize {
        let mut added = 0;
        for f in found {
            let c = ChunkRef { ns: f.ns, hash: f.hash };
            if self.entries.contains_key(&c) || (f.ns == OWN && self.putting.contains_key(&f.hash)) {
                continue;
            }
            let tick = self.bump();
            self.add(c, Entry { file_len: f.file_len, tick, used_at: f.modified.max(1) });
            added += 1;
        }
        added
    }

    fn add(&mut self, c: ChunkRef, e: Entry) {
        self.entries.insert(c, e);
        self.lru.insert((e.used_at, e.tick), c);
        let t = self.totals.entry(c.ns).or_default();
        t.0 += 1;
        t.1 += e.file_len;
        self.total_bytes += e.file_len;
    }

    /// Makes an indexed chunk a filler: least recently used of all, so the
    /// next put that needs room overwrites it (recycling its allocated file)
    /// before any real chunk is evicted.
    pub fn demote_filler(&mut self, hash: u128) -> bool {
        let Some(len) = self.remove_entry(ChunkRef::own(hash)) else { return false };
        self.low_tick -= 1;
        self.add(ChunkRef::own(hash), Entry { file_len: len, tick: self.low_tick, used_at: 0 });
        self.fillers.insert(hash);
        true
    }

    pub fn filler_count(&self) -> usize {
        self.fillers.len()
    }

    /// Chunks of this namespace (fillers included).
    pub fn len(&self) -> usize {
        self.totals.get(&OWN).map_or(0, |t| t.0 as usize)
    }

    /// Bytes of this namespace's chunks.
    pub fn used_bytes(&self) -> u64 {
        self.totals.get(&OWN).map_or(0, |t| t.1)
    }

    /// Bytes of every namespace's chunks: what the capacity bounds.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes of the chunks (any namespace) `pick` selects.
    pub fn bytes_where(&self, pick: impl Fn(ChunkRef) -> bool) -> u64 {
        self.entries.iter().filter(|(c, _)| pick(**c)).map(|(_, e)| e.file_len).sum()
    }

    /// (namespace, chunks, bytes) of the other namespaces, most bytes first.
    pub fn other_namespaces(&self) -> Vec<(NsId, u64, u64)> {
        let mut v: Vec<(NsId, u64, u64)> =
            self.totals.iter().filter(|(ns, t)| **ns != OWN && t.0 > 0).map(|(ns, t)| (*ns, t.0, t.1)).collect();
        v.sort_unstable_by_key(|(ns, _, bytes)| (std::cmp::Reverse(*bytes), *ns));
        v
    }

    pub fn contains(&self, hash: u128) -> bool {
        self.entries.contains_key(&ChunkRef::own(hash))
    }

    pub fn file_len(&self, hash: u128) -> Option<u64> {
        self.entries.get(&ChunkRef::own(hash)).map(|e| e.file_len)
    }

    /// A put of this namespace reserved room for `hash`; until `end_put` a
    /// walk skips the chunk (see `putting`).
    pub fn begin_put(&mut self, hash: u128) {
        *self.putting.entry(hash).or_default() += 1;
    }

    pub fn end_put(&mut self, hash: u128) {
        if let Some(n) = self.putting.get_mut(&hash) {
            *n -= 1;
            if *n == 0 {
                self.putting.remove(&hash);
            }
        }
    }

    /// Inserts or refreshes a chunk of this namespace as most recently used.
    pub fn insert(&mut self, hash: u128, file_len: u64) {
        let c = ChunkRef::own(hash);
        self.remove_entry(c);
        let tick = self.bump();
        self.add(c, Entry { file_len, tick, used_at: now_ns() });
    }

    pub fn touch(&mut self, hash: u128) {
        let c = ChunkRef::own(hash);
        if let Some(e) = self.entries.get(&c).copied() {
            self.lru.remove(&(e.used_at, e.tick));
            let e = Entry { tick: self.bump(), used_at: now_ns(), ..e };
            self.entries.insert(c, e);
            self.lru.insert((e.used_at, e.tick), c);
        }
    }

    /// Removes a chunk of this namespace.
    pub fn remove(&mut self, hash: u128) -> Option<u64> {
        self.remove_ref(ChunkRef::own(hash))
    }

    /// Removes a chunk of any namespace; this namespace's real chunks are
    /// logged for `take_removed`.
    pub fn remove_ref(&mut self, c: ChunkRef) -> Option<u64> {
        if let Some(removed) = &mut self.removed_during_scan {
            removed.insert(c);
        }
        let filler = c.ns == OWN && self.fillers.contains(&c.hash);
        let len = self.remove_entry(c)?;
        if c.ns == OWN && !filler {
            if self.removed_log.len() >= REMOVED_LOG_MAX {
                self.removed_log.pop_front();
                self.removed_log_dropped += 1;
            }
            self.removed_log.push_back(c.hash);
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
    /// lacks are added, ranked by their modification time, unless removed
    /// meanwhile; entries the walk did not find are dropped (another writer
    /// evicted them) unless inserted or touched since the walk began.
    /// Returns (added, dropped) of this namespace.
    pub fn refresh(&mut self, found: &[Found], since: u64) -> (usize, usize) {
        let present: HashSet<ChunkRef> = found.iter().map(|f| ChunkRef { ns: f.ns, hash: f.hash }).collect();
        let gone: Vec<ChunkRef> = self.entries.iter().filter(|(c, e)| e.tick <= since && !present.contains(c)).map(|(c, _)| *c).collect();
        let own_before = self.len();
        self.merge_scanned(found);
        let own_added = self.len() - own_before;
        let mut own_dropped = 0;
        for c in &gone {
            own_dropped += usize::from(self.remove_ref(*c).is_some() && c.ns == OWN);
        }
        (own_added, own_dropped)
    }

    fn remove_entry(&mut self, c: ChunkRef) -> Option<u64> {
        if c.ns == OWN {
            self.fillers.remove(&c.hash);
        }
        let e = self.entries.remove(&c)?;
        self.lru.remove(&(e.used_at, e.tick));
        let t = self.totals.entry(c.ns).or_default();
        t.0 -= 1;
        t.1 -= e.file_len;
        self.total_bytes -= e.file_len;
        Some(e.file_len)
    }

    /// Stalest chunks (any namespace) to drop so that `incoming` more bytes
    /// fit in `capacity`, skipping this namespace's `keep`. Does not remove them.
    pub fn victims(&self, incoming: u64, capacity: u64, keep: u128) -> Vec<(ChunkRef, u64)> {
        let need = (self.total_bytes + incoming).saturating_sub(capacity);
        self.victims_where(need, keep, |_| true)
    }

    /// Removes chosen victims from the index and returns those that were
    /// still in it, with their lengths. Chosen and taken under one lock, so no
    /// other put (or walk) can choose the same chunk before its file goes.
    pub fn take(&mut self, chosen: Vec<(ChunkRef, u64)>) -> Vec<(ChunkRef, u64)> {
        chosen.into_iter().filter_map(|(c, _)| self.remove_ref(c).map(|len| (c, len))).collect()
    }

    /// Stalest chunks matching `pick` whose bytes cover `need`, skipping
    /// this namespace's `keep`. Does not remove them.
    pub fn victims_where(&self, mut need: u64, keep: u128, pick: impl Fn(ChunkRef) -> bool) -> Vec<(ChunkRef, u64)> {
        let mut out = Vec::new();
        for (_, &c) in self.lru.iter() {
            if need == 0 {
                break;
            }
            if c == ChunkRef::own(keep) || !pick(c) {
                continue;
            }
            let len = self.entries[&c].file_len;
            out.push((c, len));
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

    /// A chunk of this namespace a scan found, modified `hash` ns after the epoch (long ago).
    fn found(hash: u128, file_len: u64) -> Found {
        Found { ns: OWN, hash, file_len, modified: hash as u64, filler: false }
    }

    fn hashes(v: Vec<(ChunkRef, u64)>) -> Vec<u128> {
        v.into_iter().map(|(c, _)| c.hash).collect()
    }

    #[test]
    fn lru_victims_cover_the_shortfall_oldest_first() {
        let mut ix = ChunkIndex::default();
        for h in 1..=4u128 {
            ix.insert(h, 100);
        }
        ix.touch(1);
        assert_eq!(ix.used_bytes(), 400);
        assert_eq!(hashes(ix.victims(150, 400, 0)), vec![2, 3]);
        assert!(ix.victims(0, 400, 0).is_empty());
        ix.remove(2);
        assert_eq!(ix.used_bytes(), 300);
        ix.insert(3, 50);
        assert_eq!(ix.used_bytes(), 250, "re-insert replaces the old size");
    }

    #[test]
    fn a_background_scan_merges_by_age_and_never_revives_removed_chunks() {
        let mut ix = ChunkIndex::default();
        ix.begin_scan();
        ix.insert(10, 100); // written while the scan ran
        ix.insert(11, 100);
        ix.remove(11); // ... and evicted again
        ix.remove(3); // an old chunk evicted (by path) before the scan reached the index
        let walk: Vec<Found> = [1, 2, 3, 10, 11].map(|h| found(h, 10)).to_vec(); // oldest first
        assert_eq!(ix.merge_scanned(&walk), 2);
        assert!(!ix.scanning());
        assert!(ix.contains(1) && ix.contains(2) && !ix.contains(3) && !ix.contains(11));
        assert_eq!(ix.file_len(10), Some(100), "the live entry wins");
        assert_eq!(ix.used_bytes(), 120);
        // Scanned chunks by their modification time, then what was written meanwhile.
        assert_eq!(hashes(ix.victims(1000, 0, 0)), vec![1, 2, 10]);
        ix.remove(1);
        assert_eq!(ix.merge_scanned(&[found(1, 10)]), 1, "outside a scan nothing is remembered");
    }

    #[test]
    fn victims_where_picks_matching_chunks_oldest_first() {
        let mut ix = ChunkIndex::default();
        for h in 1..=6u128 {
            ix.insert(h, 100);
        }
        assert_eq!(hashes(ix.victims_where(150, 4, |c| c.hash % 2 == 0)), vec![2, 6], "skips odd keys and the kept one");
        assert!(ix.victims_where(0, 0, |_| true).is_empty());
        assert_eq!(ix.victims_where(10_000, 0, |c| c.hash > 4).len(), 2, "at most what matches");
    }

    #[test]
    fn a_walk_does_not_count_a_chunk_whose_put_still_holds_its_reservation() {
        // Found between its publication and its insert: its bytes are still
        // reserved, so indexing it too would count them twice (and evict one more).
        let mut ix = ChunkIndex::default();
        ix.begin_put(5);
        ix.begin_scan();
        let since = ix.last_tick();
        assert_eq!(ix.refresh(&[found(5, 100)], since), (0, 0));
        assert_eq!(ix.used_bytes(), 0);
        ix.insert(5, 100);
        ix.end_put(5);
        ix.begin_scan();
        assert_eq!(ix.refresh(&[found(5, 100), found(6, 100)], ix.last_tick()), (1, 0));
        assert_eq!(ix.used_bytes(), 200);
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
                           // The walk: 1 and 3 still there, 2 gone (another node evicted it), 9 new (another node wrote it, long ago).
        let walk: Vec<Found> = [1, 3, 9].map(|h| found(h, 100)).to_vec();
        assert_eq!(ix.refresh(&walk, since), (1, 1));
        assert!(ix.contains(1) && !ix.contains(2) && ix.contains(3) && ix.contains(4) && ix.contains(9));
        assert_eq!(ix.used_bytes(), 400);
        assert_eq!(ix.victims(100, 400, 0)[0].0.hash, 9, "written long ago, never used here: goes first");
        let (removed, dropped) = ix.take_removed();
        assert_eq!((removed, dropped), (vec![2], 0));
        ix.insert(3, 100); // a re-insert is no removal
        ix.demote_filler(3);
        ix.remove(3); // nor is a filler leaving
        assert!(ix.take_removed().0.is_empty());
    }

    #[test]
    fn a_chunk_another_writer_published_just_now_is_fresher_than_one_used_long_ago() {
        let mut ix = ChunkIndex::default();
        ix.merge_scanned(&[found(1, 100)]); // on disk since long ago, not used here
        ix.insert(2, 100); // used here now
        let later = now_ns() + 1_000_000_000;
        ix.begin_scan();
        let since = ix.last_tick();
        ix.refresh(&[found(1, 100), found(2, 100), Found { modified: later, ..found(3, 100) }], since);
        assert_eq!(hashes(ix.victims(300, 300, 0)), vec![1, 2, 3], "by time of last use, whoever used it");
    }

    #[test]
    fn other_namespaces_count_against_the_capacity_and_are_never_looked_up() {
        let mut ix = ChunkIndex::default();
        let other = |ns: NsId, hash: u128, modified: u64| Found { ns, hash, file_len: 100, modified, filler: false };
        ix.merge_scanned(&[other(1, 7, 10), other(2, 8, 20), other(1, 9, 30), Found { modified: 15, ..found(5, 100) }]);
        ix.insert(7, 100); // this namespace's key 7: another file than namespace 1's key 7
        assert_eq!((ix.len(), ix.used_bytes(), ix.total_bytes()), (2, 200, 500));
        assert!(ix.contains(7) && !ix.contains(8) && !ix.contains(9) && ix.file_len(9).is_none());
        assert_eq!(ix.other_namespaces(), vec![(1, 2, 200), (2, 1, 100)], "most bytes first");
        // Stalest first, whatever the namespace; this namespace's own key 7 is kept when asked.
        let v = ix.victims(200, 500, 7);
        assert_eq!(v.iter().map(|(c, _)| *c).collect::<Vec<_>>(), vec![ChunkRef { ns: 1, hash: 7 }, ChunkRef::own(5)]);
        ix.touch(9); // no effect: namespace 1's chunk 9 is not this store's
        assert_eq!(ix.remove_ref(ChunkRef { ns: 1, hash: 7 }), Some(100));
        assert!(ix.contains(7), "removing another namespace's key 7 keeps this one's");
        assert_eq!(ix.other_namespaces(), vec![(1, 1, 100), (2, 1, 100)]);
        assert!(ix.take_removed().0.is_empty(), "other namespaces' chunks are not announced");
        // A refresh that no longer finds namespace 2's chunk drops it.
        ix.begin_scan();
        let since = ix.last_tick();
        ix.refresh(&[other(1, 9, 30), Found { modified: 15, ..found(5, 100) }, found(7, 100)], since);
        assert_eq!((ix.total_bytes(), ix.other_namespaces()), (300, vec![(1, 1, 100)]));
    }

    #[test]
    fn fillers_go_first_and_are_counted_until_replaced() {
        let mut ix = ChunkIndex::default();
        for h in 1..=4u128 {
            ix.insert(h, 100);
        }
        assert!(ix.demote_filler(3) && ix.demote_filler(4) && !ix.demote_filler(9));
        assert_eq!((ix.filler_count(), ix.used_bytes(), ix.len()), (2, 400, 4));
        assert_eq!(hashes(ix.victims(400, 400, 0)), vec![4, 3, 1, 2], "fillers first (last demoted first), then LRU");
        ix.remove(4);
        ix.insert(3, 100); // the same key written for real
        assert_eq!(ix.filler_count(), 0);
        ix.merge_scanned(&[Found { filler: true, ..found(7, 50) }]);
        assert_eq!(ix.filler_count(), 1);
    }
}
