//! The store's side of segment files (decision 0086): a put takes a slot
//! and is finished by the publication that lists it (on the chunk worker
//! that finished its transfer, as a chunk file's rename is); a get reads a slot
//! through a held descriptor; discovery reads other writers' indexes (every
//! namespace's at open and in walks: they count against the capacity); an
//! evicted slot is punched, never unlinked. `segments` holds the state,
//! `segment_scan` the reading of indexes.

use std::sync::Arc;
use std::time::Duration;

use super::segments::{OpenSegment, Place, Publication, REFRESH_EVERY};
use super::{Core, OpContext};
use crate::disk::format::HEADER_BYTES;
use crate::disk::index::{ChunkRef, Found};
use crate::ops::{MissKind, OpId, Outcome, Status};
use crate::stats::Stats;

impl Core {
    /// Indexes the chunks other writers published in segments since the
    /// last look (at most every `min_gap`), on every root: this namespace's,
    /// and with `all` every namespace's (and emptied segments unlinked).
    /// True when one was new.
    pub(super) fn discover_segments(&self, min_gap: Duration, all: bool) -> bool {
        let segs = &self.segments;
        let mut any = false;
        for root in 0..segs.roots.len() {
            if self.health.refusal(root).is_some() {
                continue;
            }
            let found = match segs.refresh(&self.held, &self.layout, root, min_gap, all) {
                Ok((found, unlinked)) => {
                    Stats::add(&self.stats.segments_unlinked, unlinked);
                    found
                }
                Err(e) => {
                    self.stats.record_error(format!("reading the segments of {}: {e}", segs.roots[root].dir.display()));
                    continue;
                }
            };
            if found.is_empty() {
                continue;
            }
            any = true;
            self.index.lock().unwrap().add_found(&found);
        }
        any
    }

    /// Whether `hash` (this namespace) has a place in a segment; a miss looks
    /// at this namespace's indexes once more (at most every `REFRESH_EVERY`).
    pub(super) fn segment_place(&self, hash: u128, refresh: bool) -> Option<Place> {
        let segs = &self.segments;
        if let Some(p) = segs.place(ChunkRef::own(hash)) {
            return Some(p);
        }
        if refresh {
            // Looked again whatever this look found: a walk reading the same
            // index at once may have placed the chunk first (and reported it).
            self.discover_segments(REFRESH_EVERY, false);
            return segs.place(ChunkRef::own(hash));
        }
        None
    }

    /// A written slot's put: published with the next index write of its segment.
    pub(super) fn publish_slot(&self, id: OpId, ctx: OpContext) {
        let segs = &self.segments;
        let slot = ctx.put_slot.as_ref().expect("a slot put without its slot");
        let (segment, number, hash) = (slot.segment.clone(), slot.slot, ctx.hash);
        match segs.written(&segment, number, hash, id, ctx) {
            Publication::Queued => {}
            // On this chunk worker, as a chunk file's rename is: the index write is one 4 KiB
            // pwrite, and the hand-off to a directory worker cost more than it (and queued
            // behind the opens of the next puts there).
            Publication::Write { seq, puts, seal } => self.run_publication(segment, seq, puts, seal),
        }
    }

    /// A publication: writes the index, finishes the puts
    /// it lists, and goes on while puts completed meanwhile (group commit),
    /// and with the seal once the segment is full and its last put ended.
    pub(super) fn run_publication(&self, segment: Arc<OpenSegment>, mut seq: u64, mut puts: Vec<(OpId, OpContext)>, mut seal: bool) {
        let segs = &self.segments;
        loop {
            match segs.write_index(&segment, seq, seal) {
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
                Some((next, more, sealing)) => (seq, puts, seal) = (next, more, sealing),
                None => return,
            }
        }
    }

    /// A put its segment's index now lists: indexed, counted, finished.
    fn published_slot(&self, id: OpId, mut ctx: OpContext) {
        let segs = &self.segments;
        let slot = ctx.put_slot.take().expect("a slot put without its slot");
        let place = Place { root: ctx.root, file: slot.segment.file.clone(), slot: slot.slot };
        let len = ctx.file_len as u64;
        let raced = segs.place(ChunkRef::own(ctx.hash)).is_some();
        {
            let mut index = self.index.lock().unwrap();
            if raced {
                // Published already (another put of the same key): this slot's bytes go again.
                Stats::add(&self.stats.write_races, 1);
            } else {
                index.insert(ctx.hash, len);
                segs.set_place(ChunkRef::own(ctx.hash), place.clone());
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
        self.segments.forget(ChunkRef::own(ctx.hash));
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

    /// Every chunk (any namespace) known in a segment, as a walk reports
    /// chunk files (`refresh` adds them to what it found; the index has
    /// them already, ranked when they were found).
    pub(super) fn segment_chunks(&self) -> Vec<Found> {
        let segs = &self.segments;
        let now = crate::disk::index::epoch_ns(std::time::SystemTime::now());
        segs.known().into_iter().map(|(c, file_len)| Found { ns: c.ns, hash: c.hash, file_len, modified: now, filler: false }).collect()
    }

    /// Frees an evicted or dropped chunk's bytes: its slot punched, or its
    /// file unlinked; NotFound when another store freed them first.
    pub(super) fn drop_chunk_bytes(&self, chunk: ChunkRef) -> std::io::Result<()> {
        if let Some(place) = self.segments.forget(chunk) {
            return self.segments.punch(&place);
        }
        self.held.unlink(&self.layout.chunk_path_of(chunk))
    }

    /// At close, once no put is in flight: this store's segments are sealed.
    pub(super) fn seal_segments(&self) {
        if self.segments.writes {
            self.segments.seal_all();
        }
    }
}
