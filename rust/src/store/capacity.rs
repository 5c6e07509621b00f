//! How much the store may hold: reservations of puts in flight, eviction of
//! least recently used chunks (within the capacity and the free-space
//! reserve), lowering the capacity when the filesystem fills up first
//! (ENOSPC). Runs on the caller's thread (a put making room) and on chunk
//! workers (publication, adoption, ENOSPC): never on the backend thread.

use std::sync::atomic::Ordering;

use crate::disk::files;
use crate::disk::layout::Layout;
use crate::error::{EngineError, Result};
use crate::notice::Notice;
use crate::stats::Stats;

use super::{Core, OpContext, StoreConfig};

impl Core {
    /// Makes room for a put and reserves its bytes until it is published or
    /// fails: within the capacity, and keeping the free-space reserve on the
    /// put's filesystem. Refused (a message) when even evicting every chunk on
    /// that root could not keep the reserve: other writers' space comes first.
    pub(super) fn reserve_room(&self, ctx: &mut OpContext, reuse: Option<usize>) -> std::result::Result<Option<u128>, String> {
        ctx.reserved = ctx.file_len as u64;
        let shortfall = self.free_space_shortfall(ctx.root, ctx.reserved);
        let (victim, unmet) = self.make_room(ctx.reserved, ctx.hash, reuse, shortfall.map(|s| (ctx.root, s)));
        if unmet > 0 {
            Stats::add(&self.stats.reserve_refused, 1);
            let dir = self.layout.ns_dirs()[ctx.root].display();
            return Err(format!(
                "not stored: keeping {} bytes free on the filesystem of {dir} (min_free_bytes) needs {unmet} bytes more \
                 than evicting every chunk there frees",
                self.min_free[ctx.root]
            ));
        }
        Ok(victim)
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
        let available = files::fs_space(&self.layout.ns_dirs()[root]).ok()?.available;
        let pending = self.reserved.load(Ordering::Relaxed);
        let short = reserve.saturating_add(incoming).saturating_add(pending).saturating_sub(available);
        (short > 0).then_some(short)
    }

    /// Drops a put's reservation (idempotent). A published chunk's bytes move
    /// from reserved to used under the index lock, never counted twice.
    pub(super) fn release_reservation(&self, ctx: &mut OpContext) {
        self.reserved.fetch_sub(std::mem::take(&mut ctx.reserved), Ordering::Relaxed);
    }

    /// Evicts least recently used chunks until `incoming` more bytes (beyond
    /// the indexed and the reserved ones) fit, and reserves them.
    /// With `reuse` = a root, the first victim on that root is not unlinked:
    /// it leaves the index and is returned for the caller to overwrite.
    /// With `fs_short` = (root, bytes), also evicts chunks on that root until
    /// `bytes` are freed there (the free-space reserve); returns what of it no
    /// chunk could cover.
    pub(super) fn make_room(&self, incoming: u64, keep: u128, reuse: Option<usize>, fs_short: Option<(usize, u64)>) -> (Option<u128>, u64) {
        let capacity = self.capacity.load(Ordering::Relaxed);
        let mut unmet = 0;
        let victims = {
            let index = self.index.lock().unwrap();
            let reserved = self.reserved.fetch_add(incoming, Ordering::Relaxed);
            let mut victims = index.victims(incoming + reserved, capacity, keep);
            if let Some((root, short)) = fs_short {
                let on_root = |h: u128| self.layout.root_of(h) == root;
                let freed: u64 = victims.iter().filter(|(h, _)| on_root(*h)).map(|(_, l)| l).sum();
                if short > freed {
                    let chosen: std::collections::HashSet<u128> = victims.iter().map(|(h, _)| *h).collect();
                    let more = index.victims_where(short - freed, keep, |h| on_root(h) && !chosen.contains(&h));
                    let got: u64 = more.iter().map(|(_, l)| l).sum();
                    unmet = (short - freed).saturating_sub(got);
                    Stats::add(&self.stats.reserve_evictions, more.len() as u64);
                    victims.extend(more);
                }
            }
            victims
        };
        let mut kept = None;
        for (hash, _) in victims {
            if kept.is_none() && reuse == Some(self.layout.root_of(hash)) {
                if let Some(len) = self.index.lock().unwrap().remove(hash) {
                    Stats::add(&self.stats.evicted_bytes, len);
                    Stats::add(&self.stats.evictions, 1);
                    kept = Some(hash);
                }
                continue;
            }
            if self.remove_chunk(hash) {
                Stats::add(&self.stats.evictions, 1);
            }
        }
        (kept, unmet)
    }

    /// The filesystem is full before the capacity is: lower the capacity to
    /// what the index holds now (what did fit; never below one chunk) and
    /// evict least recently used chunks until this chunk and one more like
    /// it fit, so that the next write does not hit ENOSPC again at once.
    pub(super) fn on_enospc(&self, incoming: u64, keep: u128) {
        let victims = {
            let index = self.index.lock().unwrap();
            let fits = index.used_bytes().max(incoming);
            let before = self.capacity.fetch_min(fits, Ordering::Relaxed);
            if fits < before {
                let mut notice = self.capacity_notice.lock().unwrap();
                if Stats::add_first(&self.stats.capacity_lowered, 1) {
                    *notice = Some(Notice::warning(format!(
                        "filesystem full before capacity_bytes ({} bytes): evicting on ENOSPC; capacity lowered to {fits} bytes \
                         (stats capacity_bytes shows the current value)",
                        self.configured_capacity
                    )));
                }
            }
            index.victims(incoming.saturating_mul(2), fits, keep)
        };
        Stats::add(&self.stats.enospc_retries, 1);
        for (hash, _) in victims {
            if self.remove_chunk(hash) {
                Stats::add(&self.stats.evictions, 1);
                Stats::add(&self.stats.enospc_evictions, 1);
            }
        }
    }

    pub(super) fn remove_chunk(&self, hash: u128) -> bool {
        let removed = self.index.lock().unwrap().remove(hash);
        let path = self.layout.chunk_path(hash);
        let unlinked = std::fs::remove_file(&path).is_ok();
        if let Some(len) = removed {
            Stats::add(&self.stats.evicted_bytes, len);
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
