//! Keeping the index true to a directory other writers share: the walk
//! (`refresh`) and the thread that runs it (`refresh_loop`): on a timer
//! (`RefreshPolicy::Every`), or in `Auto` only while another writer's lease is
//! live in a root (decision 0053). The thread also renews this store's lease.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::disk::scan;
use crate::disk::writers::LEASE_BEAT;
use crate::error::Result;
use crate::notice::Notice;
use crate::stats::Stats;

use super::config::{RefreshPolicy, AUTO_REFRESH_COST, AUTO_REFRESH_MAX, AUTO_REFRESH_MIN, WRITER_CHECK};
use super::{BlockStore, Core};

/// The shortest time between two walks a put asks for (`Core::walk_now`).
const WALK_NOW_GAP: Duration = Duration::from_millis(200);

impl BlockStore {
    /// Walks the directories and brings the index in line with them while
    /// the store serves: chunks other processes or nodes published since
    /// (of any namespace) are indexed, ranked by their modification time,
    /// and count against the capacity; chunks they removed leave the index;
    /// then the stalest chunks are evicted down to the capacity. Unlike
    /// `rescan`, keeps this store's recency order and what it wrote during
    /// the walk. Returns (added, dropped) of this namespace.
    pub fn refresh(&self) -> Result<(usize, usize)> {
        self.core.refresh()
    }

    /// Other writers' live leases in the roots, as last checked.
    pub fn other_writers(&self) -> u64 {
        self.core.other_writers.load(Ordering::Relaxed)
    }

    pub fn refresh_policy(&self) -> RefreshPolicy {
        self.core.refresh_policy
    }
}

impl Core {
    pub(super) fn refresh(&self) -> Result<(usize, usize)> {
        // A background scan still running owns the index's scan mode.
        self.scan.wait(None);
        // Every namespace's segments too (decision 0086): their chunks count
        // against the capacity here, and emptied ones are unlinked.
        self.discover_segments(Duration::ZERO, true);
        let since = {
            let mut index = self.index.lock().unwrap();
            index.begin_scan();
            index.last_tick()
        };
        let found = match scan::collect(&self.layout, &self.scan.stop) {
            // The chunks in segments are no files: the walk must not take them for gone.
            Ok(mut found) => {
                found.extend(self.segment_chunks());
                found
            }
            Err(e) => {
                self.index.lock().unwrap().merge_scanned(&[]);
                Stats::add(&self.stats.refresh_errors, 1);
                return Err(e);
            }
        };
        if self.scan.stop.load(Ordering::Relaxed) {
            // Closing: the walk ended early and saw only part of the tree.
            self.index.lock().unwrap().merge_scanned(&[]);
            return Ok((0, 0));
        }
        // What the others wrote counts here now: back within the capacity
        // under the same lock, so the index never shows more than the
        // capacity (the files go after the lock is released).
        let ((added, dropped), victims) = {
            let mut index = self.index.lock().unwrap();
            let counts = index.refresh(&found, since);
            let victims = index.victims(self.reserved.load(Ordering::Relaxed), self.capacity.load(Ordering::Relaxed), 0);
            (counts, self.take_victims(&mut index, victims))
        };
        self.unlink_evicted(victims);
        Stats::add(&self.stats.refreshes, 1);
        Stats::add(&self.stats.refresh_added, added as u64);
        Stats::add(&self.stats.refresh_dropped, dropped as u64);
        Ok((added, dropped))
    }

    /// Other writers' live leases in this store's roots, as last checked, and
    /// the lease directories' stamp (see `WriterLease::stamp`).
    pub(super) fn check_writers(&self) -> (usize, Vec<Option<std::time::SystemTime>>) {
        let lease = self.lease.lock().unwrap().clone();
        let n = lease.as_ref().map_or(0, |l| l.others());
        self.other_writers.store(n as u64, Ordering::Relaxed);
        (n, lease.map_or_else(Vec::new, |l| l.stamp()))
    }

    /// The refresh thread, until the store closes: renews the lease, looks
    /// for other writers, walks when `policy` says so.
    pub(super) fn refresh_loop(&self, policy: RefreshPolicy) {
        let far = Duration::from_secs(1 << 30);
        let tick = match policy {
            RefreshPolicy::Every(every) => Duration::from_millis(20).min(every),
            _ => Duration::from_millis(20),
        };
        let start = Instant::now();
        let mut next_beat = start + LEASE_BEAT;
        let mut next_check = start;
        let mut next_walk = start + if let RefreshPolicy::Every(every) = policy { every } else { far };
        let mut others = 0;
        let mut stamp = None;
        let mut last_walk = start;
        let mut asked = false;
        while !self.scan.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            if now >= next_beat {
                let lease = self.lease.lock().unwrap().clone();
                if let Some(l) = lease {
                    l.beat();
                }
                next_beat = now + LEASE_BEAT;
            }
            if self.rebuild.swap(false, Ordering::AcqRel) {
                self.rebuild_after_return();
            }
            if self.walk_now.swap(false, Ordering::AcqRel) && next_walk > now + WALK_NOW_GAP {
                // A put found the capacity held by chunks it does not know:
                // whatever the policy, or it would refuse puts until a walk.
                next_walk = now.max(last_walk + WALK_NOW_GAP);
                asked = true;
            }
            if now >= next_check {
                self.watch_roots();
                let (n, now_stamp) = self.check_writers();
                self.tend_ledgers(n == 0, false);
                // A lease created or removed since the last check (the stamp moved;
                // removing a dead one of ours moves it too: one walk more) while none
                // is live now: a writer came and went between two checks.
                let came_and_went = stamp.as_ref().is_some_and(|s| *s != now_stamp) && n == 0 && others == 0;
                stamp = Some(now_stamp);
                if policy == RefreshPolicy::Auto && came_and_went {
                    next_walk = now;
                }
                if policy == RefreshPolicy::Auto && (n > 0) != (others > 0) {
                    // A writer came (count what it writes from now on) or all
                    // left (one last walk finds what they wrote since the last).
                    next_walk = now;
                    if n > 0 && Stats::add_first(&self.stats.auto_refresh_starts, 1) {
                        // Another writer found is news, not trouble.
                        self.notices.lock().unwrap().push(Notice::info(format!(
                            "another process writes {} too: walking it while it does (refresh_interval_s=auto), so that \
                             capacity_bytes bounds what all writers store there together",
                            self.layout.roots().iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ")
                        )));
                    }
                }
                others = n;
                next_check = now + WRITER_CHECK;
            }
            let walk = match policy {
                RefreshPolicy::Off => asked && now >= next_walk,
                RefreshPolicy::Every(_) => now >= next_walk,
                RefreshPolicy::Auto => now >= next_walk,
            };
            if walk {
                asked = false;
                let began = Instant::now();
                last_walk = began;
                if let Err(e) = self.refresh() {
                    // The engine has no logger; once is enough (counted in refresh_errors).
                    if self.stats.refresh_errors.load(Ordering::Relaxed) == 1 {
                        eprintln!("pykvcache: refreshing the index failed: {e}");
                    }
                }
                next_walk = Instant::now()
                    + match policy {
                        RefreshPolicy::Every(every) => every,
                        _ if others > 0 => (began.elapsed() * AUTO_REFRESH_COST).clamp(AUTO_REFRESH_MIN, AUTO_REFRESH_MAX),
                        _ => far,
                    };
                continue;
            }
            std::thread::sleep(tick);
        }
    }
}
