//! Segment files (decision 0086): on a network filesystem, where every name
//! is a round trip, a writer appends chunks into fixed slots of a sparse
//! file of its own and publishes them by rewriting the file's index.
//!
//! ```text
//! <root>/<namespace>/log/<lease:016x>-<seq:08x>-<slot bytes>.seg
//!   [0, 4 KiB)        index copy A   (written by even publications)
//!   [4 KiB, 8 KiB)    index copy B   (odd)
//!   [8 KiB + i * slot_bytes, ...)    slot i: a chunk file image (`format`)
//! ```
//!
//! An index block lists which slots hold a published chunk and the chunk's
//! key hash; it carries its publication number and a CRC-32C of itself, so a
//! torn write of one copy leaves the other, one publication older, in force.
//! A slot holds exactly what a chunk file holds (header, payload, padding), so
//! a slot is verified, sealed and opened as a file is, at an offset. A slot
//! no index lists is not a chunk, whatever it holds: a crash between the
//! slot's write and its publication loses that chunk and no other.

use crate::checksum::crc32c;
use crate::disk::format::IO_ALIGN;

/// One index copy.
pub const INDEX_BYTES: usize = 4096;
/// Slot 0 starts after the two index copies.
pub const SLOTS_START: u64 = 2 * INDEX_BYTES as u64;
pub const INDEX_MAGIC: [u8; 8] = *b"PYKVSEGX";
pub const INDEX_VERSION: u16 = 1;
/// Slots one index block can list (a key hash each, after a presence bitmap).
pub const MAX_SLOTS: usize = (INDEX_BYTES - OFF_HASHES) / 16;
/// The directory of a namespace that holds its segments.
pub const LOG_DIR: &str = "log";

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_FLAGS: usize = 10;
const OFF_SLOTS: usize = 12;
const OFF_SEQ: usize = 16;
const OFF_SLOT_BYTES: usize = 24;
const OFF_CRC: usize = 32;
const OFF_BITMAP: usize = 64;
const BITMAP_BYTES: usize = 32;
const OFF_HASHES: usize = OFF_BITMAP + BITMAP_BYTES;

/// Index flag: its writer will add no slot (the segment is full, or its
/// writer closed it): once every listed slot is punched, anyone may unlink it.
pub const FLAG_SEALED: u16 = 1;

/// A segment's name: its writer's lease, the writer's sequence number, the
/// size of its slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentName {
    pub lease: u64,
    pub seq: u32,
    pub slot_bytes: u64,
}

impl SegmentName {
    pub fn file_name(&self) -> String {
        format!("{:016x}-{:08x}-{}.seg", self.lease, self.seq, self.slot_bytes)
    }

    /// None for any name this module did not write (never trusted as a segment).
    pub fn parse(name: &str) -> Option<Self> {
        let stem = name.strip_suffix(".seg")?;
        let mut parts = stem.split('-');
        let (lease, seq, slot) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || lease.len() != 16 || seq.len() != 8 {
            return None;
        }
        let hexdigits = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
        if !hexdigits(lease) || !hexdigits(seq) || slot.is_empty() || !slot.bytes().all(|b| b.is_ascii_digit()) || slot.starts_with('0') {
            return None;
        }
        let slot_bytes: u64 = slot.parse().ok()?;
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(IO_ALIGN as u64) {
            return None;
        }
        Some(SegmentName { lease: u64::from_str_radix(lease, 16).ok()?, seq: u32::from_str_radix(seq, 16).ok()?, slot_bytes })
    }
}

/// Where slot `slot` of a segment with `slot_bytes` slots starts.
pub fn slot_offset(slot: usize, slot_bytes: u64) -> u64 {
    SLOTS_START + slot as u64 * slot_bytes
}

/// How many slots a segment of chunk files of `slot_bytes` bytes gets: about
/// `target_bytes` of them, at least 1, at most `MAX_SLOTS`.
pub fn slots_for(slot_bytes: u64, target_bytes: u64) -> usize {
    ((target_bytes / slot_bytes.max(1)) as usize).clamp(1, MAX_SLOTS)
}

/// A decoded index: which slots hold which chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentIndex {
    /// Publication number: each rewrite of the index counts one up.
    pub seq: u64,
    pub slot_bytes: u64,
    pub slots: usize,
    pub sealed: bool,
    /// Per slot, the key hash of the chunk published there.
    pub entries: Vec<Option<u128>>,
}

impl SegmentIndex {
    pub fn new(slot_bytes: u64, slots: usize) -> Self {
        assert!((1..=MAX_SLOTS).contains(&slots), "{slots} slots (1..={MAX_SLOTS})");
        assert!(slot_bytes > 0 && slot_bytes.is_multiple_of(IO_ALIGN as u64), "slots of {slot_bytes} bytes");
        SegmentIndex { seq: 0, slot_bytes, slots, sealed: false, entries: vec![None; slots] }
    }

    /// Which copy (0: A, 1: B) publication `seq` writes.
    pub fn copy_of(seq: u64) -> usize {
        (seq % 2) as usize
    }

    /// The published chunks: (slot, key hash).
    pub fn listed(&self) -> impl Iterator<Item = (usize, u128)> + '_ {
        self.entries.iter().enumerate().filter_map(|(slot, e)| e.map(|hash| (slot, hash)))
    }

    pub fn encode(&self, block: &mut [u8]) {
        assert_eq!(block.len(), INDEX_BYTES, "an index block is {INDEX_BYTES} bytes");
        assert_eq!(self.entries.len(), self.slots, "one entry per slot");
        block.fill(0);
        block[OFF_MAGIC..OFF_MAGIC + 8].copy_from_slice(&INDEX_MAGIC);
        block[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&INDEX_VERSION.to_le_bytes());
        let flags = if self.sealed { FLAG_SEALED } else { 0 };
        block[OFF_FLAGS..OFF_FLAGS + 2].copy_from_slice(&flags.to_le_bytes());
        block[OFF_SLOTS..OFF_SLOTS + 4].copy_from_slice(&(self.slots as u32).to_le_bytes());
        block[OFF_SEQ..OFF_SEQ + 8].copy_from_slice(&self.seq.to_le_bytes());
        block[OFF_SLOT_BYTES..OFF_SLOT_BYTES + 8].copy_from_slice(&self.slot_bytes.to_le_bytes());
        for (slot, hash) in self.listed() {
            block[OFF_BITMAP + slot / 8] |= 1 << (slot % 8);
            let at = OFF_HASHES + slot * 16;
            block[at..at + 16].copy_from_slice(&hash.to_le_bytes());
        }
        let crc = crc32c(block);
        block[OFF_CRC..OFF_CRC + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// None for a block that is not a sound index (zeros, torn, foreign).
    pub fn decode(block: &[u8]) -> Option<Self> {
        if block.len() != INDEX_BYTES || block[OFF_MAGIC..OFF_MAGIC + 8] != INDEX_MAGIC {
            return None;
        }
        let u16_at = |o: usize| u16::from_le_bytes([block[o], block[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(block[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(block[o..o + 8].try_into().unwrap());
        let mut unsealed = [0u8; INDEX_BYTES];
        unsealed.copy_from_slice(block);
        unsealed[OFF_CRC..OFF_CRC + 4].fill(0);
        if crc32c(&unsealed) != u32_at(OFF_CRC) || u16_at(OFF_VERSION) != INDEX_VERSION {
            return None;
        }
        let (flags, slots, slot_bytes) = (u16_at(OFF_FLAGS), u32_at(OFF_SLOTS) as usize, u64_at(OFF_SLOT_BYTES));
        if flags & !FLAG_SEALED != 0 || !(1..=MAX_SLOTS).contains(&slots) || slot_bytes == 0 || !slot_bytes.is_multiple_of(IO_ALIGN as u64)
        {
            return None;
        }
        let entries = (0..slots)
            .map(|slot| {
                let at = OFF_HASHES + slot * 16;
                (block[OFF_BITMAP + slot / 8] & (1 << (slot % 8)) != 0).then(|| u128::from_le_bytes(block[at..at + 16].try_into().unwrap()))
            })
            .collect();
        Some(SegmentIndex { seq: u64_at(OFF_SEQ), slot_bytes, slots, sealed: flags & FLAG_SEALED != 0, entries })
    }

    /// The index in force from the two copies read together (the first
    /// `2 * INDEX_BYTES` bytes of a segment): the sound one with the higher
    /// publication number. None when neither is sound (a segment whose first
    /// publication has not landed: it lists nothing yet).
    pub fn current(both: &[u8]) -> Option<Self> {
        assert_eq!(both.len(), 2 * INDEX_BYTES, "both index copies");
        let (a, b) = (Self::decode(&both[..INDEX_BYTES]), Self::decode(&both[INDEX_BYTES..]));
        match (a, b) {
            (Some(a), Some(b)) => Some(if b.seq > a.seq { b } else { a }),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn both(a: Option<&SegmentIndex>, b: Option<&SegmentIndex>) -> Vec<u8> {
        let mut out = vec![0u8; 2 * INDEX_BYTES];
        if let Some(a) = a {
            a.encode(&mut out[..INDEX_BYTES]);
        }
        if let Some(b) = b {
            b.encode(&mut out[INDEX_BYTES..]);
        }
        out
    }

    #[test]
    fn an_index_round_trips_with_its_listed_slots_only() {
        let mut ix = SegmentIndex::new(2 << 20, MAX_SLOTS);
        ix.seq = 7;
        ix.entries[0] = Some(1);
        ix.entries[MAX_SLOTS - 1] = Some(u128::MAX);
        ix.entries[100] = Some(0); // a hash of 0 is a chunk too: presence is the bitmap's
        let mut block = vec![0u8; INDEX_BYTES];
        ix.encode(&mut block);
        let back = SegmentIndex::decode(&block).unwrap();
        assert_eq!(back, ix);
        assert_eq!(back.listed().collect::<Vec<_>>(), vec![(0, 1), (100, 0), (MAX_SLOTS - 1, u128::MAX)]);
    }

    #[test]
    fn any_flipped_bit_or_zeros_is_no_index() {
        let mut ix = SegmentIndex::new(4096, 3);
        ix.entries[1] = Some(42);
        let mut block = vec![0u8; INDEX_BYTES];
        ix.encode(&mut block);
        for byte in [0, OFF_SEQ, OFF_SLOTS, OFF_BITMAP, OFF_HASHES + 16, OFF_CRC, INDEX_BYTES - 1] {
            let mut bad = block.clone();
            bad[byte] ^= 0x10;
            assert_eq!(SegmentIndex::decode(&bad), None, "byte {byte} flipped");
        }
        assert_eq!(SegmentIndex::decode(&[0u8; INDEX_BYTES]), None);
    }

    #[test]
    fn the_newer_sound_copy_is_in_force_and_a_torn_one_leaves_the_older() {
        let mut older = SegmentIndex::new(8192, 4);
        older.seq = 4;
        older.entries[0] = Some(9);
        let mut newer = older.clone();
        newer.seq = 5;
        newer.entries[1] = Some(10);
        assert_eq!(SegmentIndex::current(&both(Some(&older), Some(&newer))), Some(newer.clone()));
        assert_eq!(SegmentIndex::current(&both(Some(&newer), Some(&older))), Some(newer.clone()));
        let mut torn = both(Some(&older), Some(&newer));
        torn[INDEX_BYTES + 3000] ^= 1; // the copy being rewritten lands half
        assert_eq!(SegmentIndex::current(&torn), Some(older));
        assert_eq!(SegmentIndex::current(&both(None, None)), None);
        assert_eq!(SegmentIndex::copy_of(4), 0);
        assert_eq!(SegmentIndex::copy_of(5), 1);
    }

    #[test]
    fn names_round_trip_and_nothing_else_parses() {
        let n = SegmentName { lease: 0xdead_beef, seq: 3, slot_bytes: 2 << 20 };
        assert_eq!(n.file_name(), "00000000deadbeef-00000003-2097152.seg");
        assert_eq!(SegmentName::parse(&n.file_name()), Some(n));
        for bad in [
            "00000000deadbeef-00000003-2097152",
            "00000000deadbeef-00000003-2097153.seg",
            "00000000deadbeef-00000003-0.seg",
            "00000000deadbeef-00000003-02097152.seg",
            "00000000DEADBEEF-00000003-2097152.seg",
            "deadbeef-00000003-2097152.seg",
            "00000000deadbeef-3-2097152.seg",
            "00000000deadbeef-00000003-2097152-1.seg",
            "../00000000deadb-00000003-2097152.seg",
            ".tmp-1-2.seg",
        ] {
            assert_eq!(SegmentName::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn slots_lie_after_both_index_copies_and_their_count_is_bounded() {
        assert_eq!(slot_offset(0, 4096), 8192);
        assert_eq!(slot_offset(3, 2 << 20), 8192 + 3 * (2 << 20));
        assert_eq!(slots_for(2 << 20, 256 << 20), 128);
        assert_eq!(slots_for(28 << 20, 256 << 20), 9);
        assert_eq!(slots_for(512 << 20, 256 << 20), 1);
        assert_eq!(slots_for(4096, 256 << 20), MAX_SLOTS);
        assert_eq!(MAX_SLOTS, 250);
    }
}
