//! The store's side of segment files (decision 0086): a put takes a slot
//! and is finished by the publication that lists it (on the chunk worker
//! that finished its transfer, as a chunk file's rename is); a get reads a slot
//! through a held descriptor; discovery reads other writers' indexes; an
//! evicted slot is punched, never unlinked. `segments` holds the state.

use std::sync::Arc;
use std::time::Duration;

use super::segments::{OpenSegment, Place, Publication, REFRESH_EVERY};
use super::{Core, OpContext};
use crate::disk::format::HEADER_BYTES;
use crate::disk::index::{ChunkRef, OWN};
use crate::ops::{MissKind, OpId, Outcome, Status};
use crate::stats::Stats;

impl Core {
    /// Indexes the chunks other writers published in segments since the
    /// last look (at most every `min_gap`), on every root. True when one was new.
    pub(super) fn discover_segments(&self, min_gap: Duration) -> bool {
        let Some(segs) = &self.segments else { return false };
        let mut any = false;
        for root in 0..segs.roots.len() {
            if self.health.refusal(root).is_some() {
                continue;
            }
            let found = match segs.refresh(&self.held, root, min_gap) {
                Ok(found) => found,
                Err(e) => {
                    self.stats.record_error(format!("reading the segments of {}: {e}", segs.roots[root].dir.display()));
                    continue;
                }
            };
            if found.is_empty() {
                continue;
            }
            any = true;
            let mut index = self.index.lock().unwrap();
            for (hash, file_len) in found {
                if !index.contains(hash) {
                    index.insert(hash, file_len);
                }
            }
        }
        any
    }

    /// Whether `hash` has a place in a segment; a miss looks at the other
    /// writers' indexes once more (at most every `REFRESH_EVERY`).
    pub(super) fn segment_place(&self, hash: u128, refresh: bool) -> Option<Place> {
        let segs = self.segments.as_ref()?;
        if let Some(p) = segs.place(hash) {
            return Some(p);
        }
        if refresh && self.discover_segments(REFRESH_EVERY) {
            return segs.place(hash);
        }
        None
    }

    /// A written slot's put: published with the next index write of its segment.
    pub(super) fn publish_slot(&self, id: OpId, ctx: OpContext) {
        let segs = self.segments.as_ref().expect("a slot put in a store without segments");
        let slot = ctx.put_slot.as_ref().expect("a slot put without its slot");
        let (segment, number, hash) = (slot.segment.clone(), slot.slot, ctx.hash);
        match segs.written(&segment, number, hash, id, ctx) {
            Publication::Queued => {}
            // On this chunk worker, as a chunk file's rename is: the index write is one 4 KiB
            // pwrite, and the hand-off to a directory worker cost more than it (and queued
            // behind the opens of the next puts there).
            Publication::Write { seq, puts } => self.run_publication(segment, seq, puts),
        }
    }

    /// A publication: writes the index, finishes the puts
    /// it lists, and goes on while puts completed meanwhile (group commit).
    pub(super) fn run_publication(&self, segment: Arc<OpenSegment>, mut seq: u64, mut puts: Vec<(OpId, OpContext)>) {
        let segs = self.segments.as_ref().expect("a publication in a store without segments");
        loop {
            match segs.write_index(&segment, seq) {
                Ok(()) => {
                    for (id, ctx) in puts {
                        self.published_slot(id, ctx);
                    }
                }
                Err(e) => {
                    for (id, ctx) in puts {
                        if let Some(slot) = &ctx.put_slot {
                            segs.unlist(&segment, slot.slot);
                        }
                        let msg = format!("publishing segment {}: {e}", segment.file.name.file_name());
                        self.finish(id, ctx, Outcome::new(Status::Error, 0, e.raw_os_error(), msg));
                    }
                }
            }
            match segs.next_publication(&segment) {
                Some((next, more)) => (seq, puts) = (next, more),
                None => return,
            }
        }
    }

    /// A put its segment's index now lists: indexed, counted, finished.
    fn published_slot(&self, id: OpId, mut ctx: OpContext) {
        let segs = self.segments.as_ref().expect("segments");
        let slot = ctx.put_slot.take().expect("a slot put without its slot");
        let place = Place { root: ctx.root, file: slot.segment.file.clone(), slot: slot.slot };
        let len = ctx.file_len as u64;
        let raced = segs.place(ctx.hash).is_some();
        {
            let mut index = self.index.lock().unwrap();
            if raced {
                // Published already (another put of the same key): this slot's bytes go again.
                Stats::add(&self.stats.write_races, 1);
            } else {
                index.insert(ctx.hash, len);
                segs.set_place(ctx.hash, place.clone());
                segs.wrote(ctx.root, len);
                // Counted before the room is released: the ledger never dips below what is on disk.
                self.ledgers.published(ctx.root, len as i64);
            }
            self.release_reservation_locked(&mut index, &mut ctx);
        }
        if raced {
            let _ = segs.punch(&place);
        }
        self.make_room(0, ctx.hash, None, None);
        let payload = ctx.payload_len as u64;
        self.finish(id, ctx, Outcome::new(Status::Ok, payload, None, ""));
    }

    /// A slot whose bytes are not a sound chunk of the key its index
    /// listed: zeros (evicted meanwhile, punched) are a miss; anything else is
    /// corrupt. Either way the place is forgotten; nothing is punched by a
    /// reader (the slot's writer or an eviction frees it).
    pub(super) fn slot_unreadable(&self, id: OpId, ctx: OpContext, reason: String) {
        if let Some(segs) = &self.segments {
            segs.forget(ctx.hash);
        }
        self.index.lock().unwrap().remove(ctx.hash);
        // SAFETY: every transfer of this get has completed (this is its verdict); its header block
        // is HEADER_BYTES long and written by nobody until `finish`.
        let header = unsafe { std::slice::from_raw_parts(self.header_ptr(id, &ctx), HEADER_BYTES) };
        if header.iter().all(|&b| b == 0) {
            return self.finish(id, ctx, Outcome::miss(MissKind::Absent, None, "chunk evicted from its segment"));
        }
        let name = ctx.read_place.as_ref().map(|p| format!("slot {} of {}", p.slot, p.file.name.file_name())).unwrap_or_default();
        self.finish(id, ctx, Outcome::new(Status::Corrupt, 0, None, format!("corrupt chunk in {name}: {reason}")))
    }

    /// Every chunk of this namespace known in a segment, as a walk reports
    /// chunk files (`refresh` adds them to what it found).
    pub(super) fn segment_chunks(&self) -> Vec<crate::disk::index::Found> {
        let Some(segs) = &self.segments else { return Vec::new() };
        let now = crate::disk::index::epoch_ns(std::time::SystemTime::now());
        segs.known()
            .into_iter()
            .map(|(hash, file_len)| crate::disk::index::Found { ns: OWN, hash, file_len, modified: now, filler: false })
            .collect()
    }

    /// Frees an evicted or dropped chunk's bytes: its slot punched, or its file unlinked.
    pub(super) fn drop_chunk_bytes(&self, chunk: ChunkRef) -> std::io::Result<()> {
        if chunk.ns == OWN {
            if let Some(place) = self.segments.as_ref().and_then(|s| s.forget(chunk.hash)) {
                return self.segments.as_ref().unwrap().punch(&place);
            }
        }
        self.held.unlink(&self.layout.chunk_path_of(chunk))
    }
}
