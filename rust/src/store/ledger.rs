//! Capacity shared with other writers, as it stands *now*: each put takes its
//! room in the root's ledger (`disk::ledger`) before its bytes are written,
//! evicting the stalest chunks it knows of until every writer's chunks and
//! puts in flight fit the capacity (decision 0053). The walks still tell a
//! store *which* chunks the others wrote (for least-recently-used order
//! across writers and true metrics); the ledger bounds *how much* they hold
//! meanwhile.
//!
//! What this store changes in a root's `published` count (chunks it
//! published, evicted, recycled, removed) is summed in `delta` and written
//! with its next transaction there: a put's own, or the refresh thread's
//! within `WRITER_CHECK`. Publishing moves bytes from in flight to published,
//! so the total is exact meanwhile; a removal not yet written only counts a
//! little too much for a moment. The refresh thread also drops the records of
//! writers whose lease is dead (their puts in flight ended with them) and,
//! while this store writes the root alone, counts `published` again from its
//! index, which is what is on disk then.
//!
//! On a network filesystem a transaction is four round trips (lock, read,
//! write, unlock: a tenth of a 2 MiB put on the suite's GlusterFS). There a
//! transaction also takes room for the next puts, `credit`: counted in this
//! store's record like puts in flight, evicted for like them, so the total
//! still bounds what is and may soon be on disk. A put that finds enough
//! credit takes it without a transaction; the refresh thread gives what is
//! left back at its next write (`WRITER_CHECK`).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::disk::index::ChunkRef;
use crate::disk::ledger::{Ledger, LedgerGuard, LedgerState};
use crate::disk::writers;
use crate::notice::Notice;
use crate::stats::Stats;

use super::{Core, OpContext};

/// How long a put waits for the walk that tells it which chunks hold the room.
const WALK_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// One root's ledger and this store's part in it.
#[derive(Default)]
pub(super) struct RootLedger {
    file: Mutex<Option<Arc<Ledger>>>,
    /// Bytes of this store's puts in flight on the root (room taken, not published).
    in_flight: AtomicU64,
    /// Change of `published` this store made since it last wrote the ledger.
    delta: AtomicI64,
    /// `in_flight` as last written.
    written: AtomicU64,
    /// Chunks taken out of the index to be evicted, not unlinked yet: not
    /// counted (the index no longer counts them either).
    evicting: AtomicI64,
    direct: AtomicBool,
    /// On a network or FUSE filesystem: transactions take `credit`.
    remote: AtomicBool,
    /// Room taken in the ledger for this store's next puts, not theirs yet
    /// (counted in its record with `in_flight`).
    credit: AtomicU64,
    /// Held across this store's transactions on the root, before the file's
    /// lock: a put that waits behind another put's transaction finds the
    /// credit it took without a lock of its own (two round trips on a network
    /// filesystem: at 8 puts in flight, half the operations a put sent there).
    gate: Mutex<()>,
}

/// Puts of the size of the one taking a transaction that its credit covers,
/// at most `1/CREDIT_SHARE` of the capacity.
const CREDIT_PUTS: u64 = 8;
const CREDIT_SHARE: u64 = 32;

#[derive(Default)]
pub(super) struct Ledgers {
    roots: Vec<RootLedger>,
    /// This store's record id: its writer lease's.
    id: u64,
}

impl Ledgers {
    pub(super) fn new(roots: usize, id: u64) -> Self {
        Ledgers { roots: (0..roots).map(|_| RootLedger::default()).collect(), id }
    }

    fn file(&self, root: usize) -> Option<Arc<Ledger>> {
        self.roots[root].file.lock().unwrap().clone()
    }

    /// Bytes this store published (+) or removed (-) on `root`.
    pub(super) fn published(&self, root: usize, bytes: i64) {
        self.roots[root].delta.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(super) fn evicting(&self, root: usize, bytes: i64) {
        self.roots[root].evicting.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(super) fn begin_put(&self, root: usize, bytes: u64) {
        self.roots[root].in_flight.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A put's room out of the credit, when there is enough: its bytes move
    /// from credit to in flight, the record's total unchanged. The caller
    /// holds the index lock, under which totals are read for eviction
    /// (`evict_for_ledger`): none sees the bytes in neither or in both.
    fn take_credit(&self, root: usize, bytes: u64) -> bool {
        let r = &self.roots[root];
        if r.credit.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_sub(bytes)).is_err() {
            return false;
        }
        r.in_flight.fetch_add(bytes, Ordering::Relaxed);
        true
    }

    pub(super) fn end_put(&self, root: usize, bytes: u64) {
        self.roots[root].in_flight.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// `state`'s total with this store's part as it is now (not as last written).
    fn total(&self, root: usize, state: &LedgerState) -> u64 {
        let r = &self.roots[root];
        let change = r.delta.load(Ordering::Relaxed) - r.evicting.load(Ordering::Relaxed);
        let published = (state.published as i64).saturating_add(change).max(0) as u64;
        let others: u64 = state.writers.iter().filter(|(w, _)| *w != self.id).map(|(_, b)| b).sum();
        published
            .saturating_add(others)
            .saturating_add(r.in_flight.load(Ordering::Relaxed))
            .saturating_add(r.credit.load(Ordering::Relaxed))
    }

    /// Writes this store's part into the locked ledger of `root`.
    fn write(&self, root: usize, g: &mut LedgerGuard<'_>) -> std::io::Result<()> {
        let r = &self.roots[root];
        let delta = r.delta.swap(0, Ordering::Relaxed);
        let in_flight = r.in_flight.load(Ordering::Relaxed).saturating_add(r.credit.load(Ordering::Relaxed));
        let before = g.state.clone();
        g.state.published = (g.state.published as i64).saturating_add(delta).max(0) as u64;
        g.state.set_writer(self.id, in_flight);
        match g.write() {
            Ok(()) => {
                r.written.store(in_flight, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                g.state = before;
                r.delta.fetch_add(delta, Ordering::Relaxed);
                Err(e)
            }
        }
    }
}

impl Core {
    /// Opens the ledger of each root where it works (`flock`); where it does
    /// not, the capacity is kept by the walks alone, as a logged fallback.
    pub(super) fn open_ledgers(&self) {
        for root in 0..self.layout.roots().len() {
            self.open_ledger(root, true);
        }
    }

    /// With `create`, at open and once a directory that went came back (its
    /// tree made again): never while it may be being deleted, where a new
    /// file would keep `rm -rf` from removing it.
    pub(super) fn open_ledger(&self, root: usize, create: bool) -> bool {
        let dir = &self.layout.roots()[root];
        // The ledger bypasses the page cache there, where another node's write must be what is read.
        let remote = crate::disk::roots::on_network_fs(dir);
        let direct = remote && self.direct_active[root];
        match Ledger::open(dir, self.file_mode, direct, create) {
            Ok(l) => {
                self.ledgers.roots[root].direct.store(direct, Ordering::Relaxed);
                self.ledgers.roots[root].remote.store(remote, Ordering::Relaxed);
                *self.ledgers.roots[root].file.lock().unwrap() = Some(Arc::new(l));
                true
            }
            Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => {
                self.stats.record_fallback(format!(
                    "no capacity ledger in {} ({e}): other writers' chunks there count only once a walk finds them",
                    dir.display()
                ));
                false
            }
        }
    }

    pub(super) fn ledgers_id(&self) -> u64 {
        self.ledgers.id
    }

    /// Counts `root`'s `published` again from the index (just walked).
    pub(super) fn recount_ledger(&self, root: usize) {
        let Some(ledger) = self.ledgers.file(root) else { return };
        let Ok(mut g) = ledger.lock() else { return };
        if self.count_ledger(root, &mut g) {
            let _ = self.ledgers.write(root, &mut g);
        }
    }

    /// Whether `root` has no ledger open (or only one removed under it).
    pub(super) fn ledgers_missing(&self, root: usize) -> bool {
        self.ledgers.file(root).is_none_or(|l| l.detached())
    }

    /// Takes `ctx`'s room in the ledger of its root, evicting what it must
    /// first; `local` makes room as without a ledger (the index's view, the
    /// free-space reserve) and runs under the ledger's lock, so that its
    /// evictions are counted in the same transaction. Returns `local`'s
    /// result, or the refusal when the capacity is held by chunks this store
    /// does not know yet (another writer's, published since its last walk):
    /// then a walk is due at once.
    pub(super) fn reserve_shared<T>(
        &self,
        ctx: &mut OpContext,
        reuse: Option<usize>,
        local: impl FnOnce(&mut OpContext) -> Result<T, (i32, String)>,
    ) -> Result<T, (i32, String)> {
        let root = ctx.root;
        // Counted in flight once the ledger is locked, as the index counts it
        // (`make_room`): not while it waits behind another put's transaction.
        let Some(ledger) = self.ledgers.file(root) else {
            self.ledgers.begin_put(root, ctx.reserved);
            return local(ctx);
        };
        if self.take_credit(root, ctx.reserved) {
            return local(ctx);
        }
        let gate = self.ledgers.roots[root].gate.lock().unwrap();
        if self.take_credit(root, ctx.reserved) {
            // Another put's transaction took credit while this one waited.
            drop(gate);
            return local(ctx);
        }
        let mut g = match ledger.lock() {
            Ok(g) => g,
            Err(e) => {
                self.stats.record_error(format!("locking the capacity ledger {}: {e}", ledger.path().display()));
                self.ledgers.begin_put(root, ctx.reserved);
                return local(ctx);
            }
        };
        // What is left is less than a put: given back, taken anew below.
        self.ledgers.roots[root].credit.store(0, Ordering::Relaxed);
        self.ledgers.begin_put(root, ctx.reserved);
        if !g.state.counted && !self.count_ledger(root, &mut g) {
            // Nobody counted it yet and this store's index is not complete.
            drop(g);
            return local(ctx);
        }
        let made = local(ctx)?;
        // While a background scan still builds the index, its choice of
        // victims would be blind (the stalest chunks are the ones it has not
        // reached): the put is recorded, the eviction waits for the index.
        let indexed = self.scan.report().done;
        let mut unmet = if indexed { self.evict_for_ledger(&g.state, ctx, reuse) } else { 0 };
        if unmet == 0 && indexed {
            self.take_room_ahead(root, &g.state, ctx);
        }
        self.write_ledger(root, &ledger, &mut g);
        drop(g);
        drop(gate);
        if unmet > 0 {
            // The room is held by chunks this store does not know of. Its
            // put stays recorded meanwhile (the others see the total over
            // the capacity and evict too); the walk tells it which they are.
            self.wait_for_walk();
            if let Ok(mut g) = ledger.lock() {
                unmet = self.evict_for_ledger(&g.state, ctx, reuse);
                self.write_ledger(root, &ledger, &mut g);
            }
        }
        if unmet > 0 {
            Stats::add(&self.stats.shared_capacity_refused, 1);
            self.walk_now.store(true, Ordering::Release);
            return Err((
                libc::EAGAIN,
                format!(
                    "not stored: capacity_bytes ({} bytes) is held by {unmet} bytes more of chunks other writers of {} \
                     published or are writing, which this store does not know yet (walking the directory now)",
                    self.capacity.load(Ordering::Relaxed),
                    self.layout.roots()[root].display()
                ),
            ));
        }
        Ok(made)
    }

    /// `Ledgers::take_credit` under the index lock; no lock where there is
    /// no credit (every local directory).
    fn take_credit(&self, root: usize, bytes: u64) -> bool {
        if self.ledgers.roots[root].credit.load(Ordering::Relaxed) < bytes {
            return false;
        }
        let _index = self.index.lock().unwrap();
        self.ledgers.take_credit(root, bytes)
    }

    /// On a network filesystem, room for the next puts (`credit`) where the
    /// capacity has it or eviction makes it; none where it does not.
    fn take_room_ahead(&self, root: usize, state: &LedgerState, ctx: &mut OpContext) {
        let r = &self.ledgers.roots[root];
        if !r.remote.load(Ordering::Relaxed) {
            return;
        }
        let want = ctx.reserved.saturating_mul(CREDIT_PUTS).min(self.capacity.load(Ordering::Relaxed) / CREDIT_SHARE);
        if want < ctx.reserved {
            return;
        }
        r.credit.store(want, Ordering::Relaxed);
        if self.evict_for_ledger(state, ctx, None) > 0 {
            r.credit.store(0, Ordering::Relaxed);
        }
    }

    fn write_ledger(&self, root: usize, ledger: &Ledger, g: &mut LedgerGuard<'_>) {
        if let Err(e) = self.ledgers.write(root, g) {
            self.stats.record_error(format!("writing the capacity ledger {}: {e}", ledger.path().display()));
        }
    }

    /// Asks the refresh thread for a walk and waits for it, at most `WALK_WAIT`.
    fn wait_for_walk(&self) {
        let before = self.stats.refreshes.load(Ordering::Relaxed);
        self.walk_now.store(true, Ordering::Release);
        let until = std::time::Instant::now() + WALK_WAIT.min(self.health.deadline / 2);
        while self.stats.refreshes.load(Ordering::Relaxed) == before && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Evicts the stalest indexed chunks until the ledger's total (every
    /// root's) fits the capacity; the bytes still missing (0: it fits). The
    /// first victim on the `reuse` root becomes `ctx`'s file when it has none
    /// yet: overwriting it costs less than a new file.
    fn evict_for_ledger(&self, state: &LedgerState, ctx: &mut OpContext, reuse: Option<usize>) -> u64 {
        let (root, keep) = (ctx.root, ctx.hash);
        let capacity = self.capacity.load(Ordering::Relaxed);
        loop {
            let mut others = 0u64;
            for other in (0..self.ledgers.roots.len()).filter(|r| *r != root) {
                if let Some(s) = self.ledgers.file(other).and_then(|l| l.peek().ok()) {
                    others = others.saturating_add(self.ledgers.total(other, &s));
                }
            }
            let (need, victims) = {
                let mut index = self.index.lock().unwrap();
                // Read under the index lock: a publish moves its bytes from in
                // flight to published under it, so this never sees them in both
                // (and evicts a chunk too many).
                let need = self.ledgers.total(root, state).saturating_add(others).saturating_sub(capacity);
                if need == 0 {
                    return 0;
                }
                let v = index.victims_where(need, keep, |_| true);
                (need, self.take_victims(&mut index, v))
            };
            if victims.is_empty() {
                // What this store cannot evict: chunks it does not know and the
                // others' puts in flight. Its own puts in flight beyond the
                // capacity (one chunk larger than a capacity lowered by ENOSPC)
                // are not the others' doing: ENOSPC answers them.
                let own = self.ledgers.roots[root].in_flight.load(Ordering::Relaxed);
                return need.min(self.ledgers.total(root, state).saturating_sub(own));
            }
            let mut victims = victims;
            if ctx.claimed.is_none() {
                if let Some(i) = victims.iter().position(|(c, _)| reuse == Some(self.layout.root_of_ref(*c))) {
                    let (c, len) = victims.remove(i);
                    self.count_eviction(c, len);
                    self.take_victim(ctx, (c, len));
                }
            }
            // Each file this store removes lowers `published` (a file another
            // writer removed first was counted by that writer, and says that
            // the index is behind: a walk is due).
            if self.unlink_evicted(victims) > 0 {
                self.walk_now.store(true, Ordering::Release);
            }
        }
    }

    /// Counts an uncounted ledger from the index, when the index is complete.
    fn count_ledger(&self, root: usize, g: &mut LedgerGuard<'_>) -> bool {
        if !self.scan.report().done {
            return false;
        }
        let published = {
            let index = self.index.lock().unwrap();
            self.ledgers.roots[root].delta.store(0, Ordering::Relaxed);
            index.bytes_where(|c: ChunkRef| self.layout.root_of_ref(c) == root)
        };
        g.state.published = published;
        true
    }

    /// The refresh thread's care of the ledgers, every `WRITER_CHECK` (and
    /// once at open, `walked`: the index is the open-time scan): a ledger
    /// removed under this store is looked for again; records of dead writers
    /// are dropped; this store's changes are written. The count is taken
    /// again from the index, the directory walked just before, with `alone`
    /// (nobody else changes it now) and when a writer died: what it
    /// published or removed since its last transaction died with it.
    pub(super) fn tend_ledgers(&self, alone: bool, walked: bool) {
        for root in 0..self.ledgers.roots.len() {
            if self.health.refusal(root).is_some() {
                continue;
            }
            let r = &self.ledgers.roots[root];
            let ledger = match self.ledgers.file(root) {
                Some(l) if !l.detached() => l,
                // Removed or replaced under this store: the one at the path
                // now, if any (another writer's or a returned directory's),
                // else none until this store makes it again (`recovery`).
                _ => {
                    *r.file.lock().unwrap() = None;
                    if !self.open_ledger(root, false) {
                        continue;
                    }
                    let Some(l) = self.ledgers.file(root) else { continue };
                    l
                }
            };
            let Ok(seen) = ledger.peek() else { continue };
            let dir = &self.layout.roots()[root];
            let dead: Vec<u64> =
                seen.writers.iter().map(|(w, _)| *w).filter(|w| *w != self.ledgers.id && !writers::is_live(dir, *w)).collect();
            // Credit left is given back: room held for puts that are not coming.
            let credit = r.credit.swap(0, Ordering::Relaxed);
            let changed = credit > 0
                || r.delta.load(Ordering::Relaxed) != 0
                || r.in_flight.load(Ordering::Relaxed) != r.written.load(Ordering::Relaxed);
            if !changed && !alone && dead.is_empty() && seen.counted {
                continue;
            }
            if !dead.is_empty() && !walked {
                let _ = self.refresh();
            }
            let Ok(mut g) = ledger.lock() else { continue };
            g.state.writers.retain(|(w, _)| !dead.contains(w));
            if (alone || !dead.is_empty() || !g.state.counted) && !self.count_ledger(root, &mut g) {
                continue;
            }
            if alone {
                g.state.writers.retain(|(w, _)| *w == self.ledgers.id);
            }
            if !dead.is_empty() {
                self.notices.lock().unwrap().push(Notice::info(format!(
                    "{} writer(s) of {} ended without closing: their puts in flight no longer count against capacity_bytes",
                    dead.len(),
                    dir.display()
                )));
            }
            let _ = self.ledgers.write(root, &mut g);
        }
    }

    /// At close, once no put is in flight: this store's record leaves the
    /// ledgers, its last changes written.
    pub(super) fn close_ledgers(&self) {
        for root in 0..self.ledgers.roots.len() {
            let Some(ledger) = self.ledgers.file(root) else { continue };
            let Ok(mut g) = ledger.lock() else { continue };
            if self.ledgers.write(root, &mut g).is_ok() {
                g.state.writers.retain(|(w, _)| *w != self.ledgers.id);
                let _ = g.write();
            }
        }
    }
}
