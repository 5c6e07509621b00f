//! How much the store may hold: reservations of puts in flight, eviction of
//! the stalest chunks (within the capacity and the free-space reserve),
//! lowering the capacity when the filesystem fills up first (ENOSPC). The
//! capacity spans every namespace under the roots: other namespaces' chunks
//! count and are evicted too, stalest first (decision 0053). Runs on the
//! caller's thread (a put making room), on chunk workers (publication,
//! adoption, ENOSPC) and the refresh thread: never on the backend thread.

use std::sync::atomic::Ordering;

use crate::disk::files;
use crate::disk::index::{ChunkIndex, ChunkRef, OWN};
use crate::disk::layout::Layout;
use crate::error::{EngineError, Result};
use crate::notice::Notice;
use crate::stats::Stats;

use super::{BlockStore, Core, OpContext, StoreConfig};

impl BlockStore {
    /// Chunks and bytes of the other namespaces under the roots, which count
    /// against the capacity (decision 0053).
    pub fn other_namespace_usage(&self) -> (u64, u64) {
        let others = self.core.index.lock().unwrap().other_namespaces();
        (others.iter().map(|(_, c, _)| c).sum(), others.iter().map(|(_, _, b)| b).sum())
    }

    /// What holds the indexed space: this namespace and the largest others.
    pub fn space_holders(&self) -> String {
        self.core.space_holders()
    }
}

impl Core {
    /// Makes room for a put and reserves its bytes until it is published or
    /// fails: within the capacity, and keeping the free-space reserve on the
    /// put's filesystem. Refused (a message) when even evicting every chunk on
    /// that root could not keep the reserve: other writers' space comes first.
    /// Where a victim's file can be reused (`reuse`), it is claimed here, into
    /// `ctx.write_file`. With a capacity ledger on the root, all of it runs
    /// under the ledger's lock (`reserve_shared`), which may evict more.
    pub(super) fn reserve_room(&self, ctx: &mut OpContext, reuse: Option<usize>) -> std::result::Result<(), (i32, String)> {
        ctx.reserved = ctx.file_len as u64;
        self.reserve_shared(ctx, reuse, |ctx| {
            let victim = self.reserve_locally(ctx, reuse).map_err(|msg| (libc::ENOSPC, msg))?;
            if let Some(v) = victim {
                self.take_victim(ctx, v);
            }
            Ok(())
        })
    }

    /// `reserve_room` as this store's index sees the capacity, and the free-space reserve.
    fn reserve_locally(&self, ctx: &mut OpContext, reuse: Option<usize>) -> std::result::Result<Option<(ChunkRef, u64)>, String> {
        let shortfall = self.free_space_shortfall(ctx.root, ctx.reserved);
        let (victim, unmet) = self.make_room(ctx.reserved, ctx.hash, reuse, shortfall.map(|s| (ctx.root, s)));
        if unmet > 0 {
            if let Some((c, len)) = victim {
                // Evicted (and counted) already: its file goes too, not left unindexed.
                let root = self.layout.root_of_ref(c);
                if self.drop_chunk_bytes(c).is_ok() {
                    self.ledgers.published(root, -(len as i64));
                }
                self.ledgers.evicting(root, -(len as i64));
            }
            let dir = self.layout.roots()[ctx.root].display();
            let holders = self.space_holders();
            let space = files::fs_space(&self.layout.roots()[ctx.root])
                .map(|s| format!("{} of {} bytes free", s.available, s.total))
                .unwrap_or_else(|e| format!("statvfs: {e}"));
            let msg = format!(
                "not stored: keeping {} bytes free on the filesystem of {dir} (min_free_bytes; {space}) needs {unmet} \
                 bytes more than evicting every chunk there frees: files other than pykvcache's chunks hold it; \
                 the chunks under {dir}: {holders}",
                self.min_free[ctx.root]
            );
            if Stats::add_first(&self.stats.reserve_refused, 1) {
                self.notices.lock().unwrap().push(Notice::warning(msg.clone()));
            }
            return Err(msg);
        }
        Ok(victim)
    }

    /// What holds the indexed bytes: this namespace, then the other
    /// namespaces with the most bytes (the top few), for log lines.
    pub(super) fn space_holders(&self) -> String {
        const TOP: usize = 3;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        // A snapshot: the labels are read from disk without the index lock.
        let (len, used, others) = {
            let index = self.index.lock().unwrap();
            (index.len(), index.used_bytes(), index.other_namespaces())
        };
        let mut parts = vec![format!("this namespace {:.1} MiB in {len} chunks", mib(used))];
        for (ns, chunks, bytes) in others.iter().take(TOP) {
            parts.push(format!("{} {:.1} MiB in {chunks} chunks", self.layout.describe(*ns), mib(*bytes)));
        }
        if others.len() > TOP {
            let rest: u64 = others[TOP..].iter().map(|(_, _, b)| b).sum();
            parts.push(format!("{} more namespaces {:.1} MiB", others.len() - TOP, mib(rest)));
        }
        parts.join("; ")
    }

    /// Bytes to free on `root`'s filesystem so that `incoming` more leaves
    /// its reserve free; None when there is no reserve or no shortfall.
    /// What other puts reserved counts as not yet allocated (they may have
    /// fallocated already: then this evicts a little early, never late).
    fn free_space_shortfall(&self, root: usize, incoming: u64) -> Option<u64> {
        let reserve = self.min_free[root];
        if reserve == 0 {
            return None;
        }
        let sample = || files::fs_space_held(&self.held, &self.layout.ns_dirs()[root]).ok().map(|s| s.available);
        let available = match Some(&self.segments).filter(|s| s.writes) {
            Some(segs) => segs.available(root, sample)?,
            None => sample()?,
        };
        let pending = self.reserved.load(Ordering::Relaxed);
        let short = reserve.saturating_add(incoming).saturating_add(pending).saturating_sub(available);
        (short > 0).then_some(short)
    }

    /// Drops a put's reservation (idempotent).
    pub(super) fn release_reservation(&self, ctx: &mut OpContext) {
        if ctx.reserved > 0 {
            let mut index = self.index.lock().unwrap();
            self.release_reservation_locked(&mut index, ctx);
        }
    }

    /// `release_reservation` under the index lock: a published chunk's bytes
    /// move from reserved to used in one step, never counted twice (nor by a
    /// walk that found the file between its publication and the insert).
    pub(super) fn release_reservation_locked(&self, index: &mut ChunkIndex, ctx: &mut OpContext) {
        if ctx.reserved > 0 {
            index.end_put(ctx.hash);
            self.ledgers.end_put(ctx.root, ctx.reserved);
            self.reserved.fetch_sub(std::mem::take(&mut ctx.reserved), Ordering::Relaxed);
        }
    }

    /// Evicts the stalest chunks (any namespace) until `incoming` more bytes
    /// (beyond the indexed and the reserved ones) fit, and reserves them.
    /// With `reuse` = a root, the first victim on that root is not unlinked:
    /// it leaves the index and is returned for the caller to overwrite.
    /// With `fs_short` = (root, bytes), also evicts chunks on that root until
    /// `bytes` are freed there (the free-space reserve); returns what of it no
    /// chunk could cover.
    pub(super) fn make_room(
        &self,
        incoming: u64,
        keep: u128,
        reuse: Option<usize>,
        fs_short: Option<(usize, u64)>,
    ) -> (Option<(ChunkRef, u64)>, u64) {
        let capacity = self.capacity.load(Ordering::Relaxed);
        let mut unmet = 0;
        let victims = {
            let mut index = self.index.lock().unwrap();
            let reserved = self.reserved.fetch_add(incoming, Ordering::Relaxed);
            if incoming > 0 {
                // The reservation is `keep`'s put in flight: a walk must not count it too.
                index.begin_put(keep);
            }
            let mut victims = index.victims(incoming + reserved, capacity, keep);
            if let Some((root, short)) = fs_short {
                let on_root = |c: ChunkRef| self.layout.root_of_ref(c) == root;
                let freed: u64 = victims.iter().filter(|(c, _)| on_root(*c)).map(|(_, l)| l).sum();
                if short > freed {
                    let chosen: std::collections::HashSet<ChunkRef> = victims.iter().map(|(c, _)| *c).collect();
                    let more = index.victims_where(short - freed, keep, |c| on_root(c) && !chosen.contains(&c));
                    let got: u64 = more.iter().map(|(_, l)| l).sum();
                    unmet = (short - freed).saturating_sub(got);
                    Stats::add(&self.stats.reserve_evictions, more.len() as u64);
                    victims.extend(more);
                }
            }
            // Taken out where they are chosen: two puts choosing at once must
            // not both evict (and recycle) the same stalest chunk.
            self.take_victims(&mut index, victims)
        };
        self.notice_other_namespaces(&victims);
        let mut victims = victims;
        let kept = victims.iter().position(|(c, _)| reuse == Some(self.layout.root_of_ref(*c))).map(|i| victims.remove(i));
        if let Some((chunk, len)) = kept {
            self.count_eviction(chunk, len);
        }
        self.unlink_evicted(victims);
        (kept, unmet)
    }

    /// Once per store, the first time another namespace's chunk is to go:
    /// a log line saying what holds the space.
    fn notice_other_namespaces(&self, victims: &[(ChunkRef, u64)]) {
        if victims.iter().any(|(c, _)| c.ns != OWN) && !self.other_ns_noticed.swap(true, Ordering::Relaxed) {
            let holders = self.space_holders();
            self.notices.lock().unwrap().push(Notice::warning(format!(
                "capacity_bytes ({} bytes) bounds every namespace under {} together: evicting the stalest \
                 chunks, other namespaces' included (decision 0053); held before: {holders}",
                self.capacity.load(Ordering::Relaxed),
                self.layout.roots().iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ")
            )));
        }
    }

    /// Takes chosen victims out of the index (under its lock); until each is
    /// unlinked (`unlink_evicted`) or claimed, the capacity ledger counts it
    /// as going, as the index does: a put meanwhile evicts no second chunk.
    pub(super) fn take_victims(&self, index: &mut ChunkIndex, chosen: Vec<(ChunkRef, u64)>) -> Vec<(ChunkRef, u64)> {
        let taken = index.take(chosen);
        for (c, len) in &taken {
            self.ledgers.evicting(self.layout.root_of_ref(*c), *len as i64);
        }
        taken
    }

    /// Unlinks and counts chunks already taken out of the index (by whoever
    /// chose them under its lock, `take_victims`). Returns how many files were
    /// gone already (another writer evicted them: the index is behind the directory).
    pub(super) fn unlink_evicted(&self, victims: Vec<(ChunkRef, u64)>) -> usize {
        self.notice_other_namespaces(&victims);
        let mut gone = 0;
        for (chunk, len) in victims {
            gone += usize::from(!self.free_victim(chunk, len));
            self.count_eviction(chunk, len);
        }
        gone
    }

    /// Frees one victim taken out of the index (its file unlinked or its
    /// slot punched) and takes its bytes out of the ledger. False when they
    /// were gone already (another writer evicted it first).
    pub(super) fn free_victim(&self, chunk: ChunkRef, len: u64) -> bool {
        let root = self.layout.root_of_ref(chunk);
        let gone = match self.drop_chunk_bytes(chunk) {
            Ok(()) => {
                self.ledgers.published(root, -(len as i64));
                false
            }
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        self.ledgers.evicting(root, -(len as i64));
        !gone
    }

    pub(super) fn count_eviction(&self, chunk: ChunkRef, len: u64) {
        Stats::add(&self.stats.evicted_bytes, len);
        Stats::add(&self.stats.evictions, 1);
        if chunk.ns != OWN {
            Stats::add(&self.stats.other_namespace_evictions, 1);
        }
    }

    /// The filesystem is full before the capacity is: lower the capacity to
    /// what the index holds now (what did fit; never below one chunk) and
    /// evict least recently used chunks until this chunk and one more like
    /// it fit, so that the next write does not hit ENOSPC again at once.
    pub(super) fn on_enospc(&self, incoming: u64, keep: u128) {
        let victims = {
            let mut index = self.index.lock().unwrap();
            let fits = index.total_bytes().max(incoming);
            let before = self.capacity.fetch_min(fits, Ordering::Relaxed);
            if fits < before && Stats::add_first(&self.stats.capacity_lowered, 1) {
                self.notices.lock().unwrap().push(Notice::warning(format!(
                    "filesystem full before capacity_bytes ({} bytes): evicting on ENOSPC; capacity lowered to {fits} bytes \
                     (stats capacity_bytes shows the current value)",
                    self.configured_capacity
                )));
            }
            let victims = index.victims(incoming.saturating_mul(2), fits, keep);
            self.take_victims(&mut index, victims)
        };
        Stats::add(&self.stats.enospc_retries, 1);
        Stats::add(&self.stats.enospc_evictions, victims.len() as u64);
        self.unlink_evicted(victims);
    }

    /// Drops a chunk of this namespace (corrupt, vanished): index and file.
    pub(super) fn remove_chunk(&self, hash: u128) -> bool {
        let removed = self.index.lock().unwrap().remove(hash);
        let unlinked = self.drop_chunk_bytes(ChunkRef::own(hash)).is_ok();
        if let Some(len) = removed {
            Stats::add(&self.stats.evicted_bytes, len);
            if unlinked {
                self.ledgers.published(self.layout.root_of(hash), -(len as i64));
            }
        }
        removed.is_some() || unlinked
    }
}

pub(super) fn free_space_plan(layout: &Layout, config: &StoreConfig) -> Result<(Vec<u64>, Vec<String>)> {
    let mut reserves = Vec::new();
    let mut seen = Vec::new();
    let (mut total, mut kept_free) = (0u64, 0u64);
    let mut warnings = Vec::new();
    for dir in layout.ns_dirs() {
        let space = files::fs_space(dir).map_err(|e| EngineError::io(format!("statvfs {}", dir.display()), e))?;
        let reserve = config.min_free.bytes_for(space.total);
        reserves.push(reserve);
        if seen.contains(&space.fsid) {
            continue;
        }
        seen.push(space.fsid);
        total = total.saturating_add(space.total);
        kept_free = kept_free.saturating_add(reserve);
        if reserve > 0 && space.available < reserve {
            warnings.push(format!(
                "only {} bytes free on the filesystem of {} ({} bytes), less than the {reserve} bytes pykvcache keeps free \
                 (min_free_bytes): puts evict this store's chunks there and are refused while that is not enough",
                space.available,
                dir.display(),
                space.total
            ));
        }
    }
    if config.capacity_bytes > total {
        warnings.push(format!(
            "capacity_bytes ({} bytes) exceeds the storage filesystem size ({total} bytes): the store grows until \
             {kept_free} bytes are left free (min_free_bytes) and evicts from there",
            config.capacity_bytes
        ));
    }
    Ok((reserves, warnings))
}
