//! In-memory index of the chunks present on disk, in LRU order, with the
//! byte accounting that enforces the capacity limit.

use std::collections::{BTreeMap, HashMap};

#[derive(Clone, Copy, Debug)]
struct Entry {
    file_len: u64,
    tick: u64,
}

#[derive(Default)]
pub struct ChunkIndex {
    entries: HashMap<u128, Entry>,
    lru: BTreeMap<u64, u128>,
    next_tick: u64,
    used: u64,
}

impl ChunkIndex {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
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
        self.remove(hash);
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
}
