//! A storage directory that goes away under a running store (deleted by a
//! cleanup job, moved, replaced, its filesystem unmounted) and comes back.
//!
//! - **Noticed** by a put that finds its shard directory missing, and by the
//!   refresh thread's look at each root every `WRITER_CHECK` (a few `lstat`s):
//!   the directory's breaker opens at once (`Health::gone`): puts are skipped
//!   and counted, gets are misses, nothing touches the directory.
//! - **Never re-created**: the root is not ours to make again. It may be the
//!   mountpoint of a filesystem that went away, where writing would fill the
//!   disk below it; it is also what an operator removed on purpose.
//! - **Back** once a directory is at the root's path again and is the same
//!   place (`RootIdentity::same_place`): the breaker's probe, every
//!   `GONE_RETRY`, re-creates this namespace's directory and shards under it,
//!   checks it as at open, and closes the breaker; the refresh thread then
//!   walks the roots (the index is rebuilt from what is there: chunks that
//!   came back with it are served again, those that went are dropped) and
//!   takes the writer lease again.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::disk::files;
use crate::disk::layout::check_root;
use crate::disk::roots::RootIdentity;
use crate::disk::writers::WriterLease;

use super::Core;

impl Core {
    /// Why root `root`'s tree (root, namespace directory, `shard`) is not
    /// usable now; None when it is all there.
    fn missing(&self, root: usize, shard: Option<&Path>) -> Option<String> {
        let root_dir = &self.layout.roots()[root];
        let now = match RootIdentity::of(root_dir) {
            Ok(now) => now,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(format!("{} is gone", root_dir.display())),
            Err(e) => return Some(format!("{}: {e}", root_dir.display())),
        };
        let known = self.root_ids.lock().unwrap()[root];
        if let Some(k) = known.filter(|k| !k.same_place(&now)) {
            return Some(format!("{}: {}", root_dir.display(), k.elsewhere(&now)));
        }
        let ns_dir = &self.layout.ns_dirs()[root];
        for dir in std::iter::once(ns_dir.as_path()).chain(shard) {
            if std::fs::symlink_metadata(dir).is_err() {
                return Some(format!("{} is gone", dir.display()));
            }
        }
        if known.is_some_and(|k| !k.same_directory(&now)) {
            // Made again at its path, by someone else, with our namespace
            // directory in it: usable, but the index must be rebuilt from it.
            self.root_ids.lock().unwrap()[root] = Some(now);
            self.forget_descriptors(root);
            self.rebuild.store(true, Ordering::Release);
        }
        None
    }

    /// Forgets every descriptor held in `root` (directories, segments): they
    /// may name what is no longer at their paths; reopened on use.
    pub(super) fn forget_descriptors(&self, root: usize) {
        self.held.forget_all(&self.layout.roots()[root]);
        self.segments.forget_root(root);
    }

    /// A put found `shard` missing (creating or publishing its file failed
    /// with ENOENT): when the directory is gone, its breaker opens (true).
    pub(super) fn check_tree(&self, root: usize, shard: &Path) -> bool {
        match self.missing(root, Some(shard)) {
            Some(what) => {
                self.forget_descriptors(root);
                self.health.gone(root, &what, Instant::now());
                true
            }
            None => false,
        }
    }

    /// The refresh thread's look at every root whose breaker is closed.
    pub(super) fn watch_roots(&self) {
        for root in 0..self.layout.roots().len() {
            if self.health.refusal(root).is_none() {
                if let Some(what) = self.missing(root, None) {
                    self.forget_descriptors(root);
                    self.health.gone(root, &what, Instant::now());
                }
            }
        }
    }

    /// The breaker's probe of `root`, on one of its directory workers: the
    /// directory is there, the same place, ours, its tree complete (made
    /// again if the store found it gone), and a small file round-trips.
    pub(super) fn probe_dir(&self, root: usize, number: u64) {
        let result = self.recover(root);
        if matches!(result, Ok(true)) {
            // Before the breaker closes: the walk follows at once.
            self.rebuild.store(true, Ordering::Release);
        }
        self.health.probe_result(root, number, result.map(|_| ()), Instant::now());
    }

    /// `probe_dir`'s checks; Ok(true) when the index must be rebuilt.
    fn recover(&self, root: usize) -> std::io::Result<bool> {
        let gone = self.health.is_gone(root);
        let root_dir = &self.layout.roots()[root];
        // Whatever opened the breaker (a directory gone, a mount replaced, a
        // dead network client), descriptors held from before may name what is
        // no longer at the paths: reopened on use.
        self.forget_descriptors(root);
        let now = RootIdentity::of(root_dir)?;
        let known = self.root_ids.lock().unwrap()[root];
        if let Some(k) = known.filter(|k| !k.same_place(&now)) {
            return Err(std::io::Error::other(k.elsewhere(&now)));
        }
        check_root(root_dir, &self.permissions).map_err(|e| std::io::Error::other(e.to_string()))?;
        let replaced = known.is_some_and(|k| !k.same_directory(&now));
        if gone || replaced {
            self.layout.ensure_tree(root, &self.permissions)?;
        }
        files::probe_health(&self.layout.ns_dirs()[root])?;
        self.held.hold(&self.layout.ns_dirs()[root]);
        self.root_ids.lock().unwrap()[root] = Some(now);
        Ok(gone || replaced)
    }

    /// On the refresh thread, after a directory came back: a new writer
    /// lease (the old one's files went with the directory) and a walk that
    /// rebuilds the index from what is there.
    pub(super) fn rebuild_after_return(&self) {
        // The old lease's files go first (where still there), then the same
        // id is taken again: it names this store's capacity ledger records.
        // None once `close` took the lease.
        let Some(old) = self.lease.lock().unwrap().take() else { return };
        drop(old);
        let (lease, _) =
            WriterLease::take_as(self.layout.roots(), self.permissions.dir_mode, self.permissions.file_mode, self.ledgers_id());
        {
            let mut held = self.lease.lock().unwrap();
            if !self.scan.stop.load(Ordering::Relaxed) {
                *held = Some(Arc::new(lease));
            }
        }
        for root in 0..self.layout.roots().len() {
            if self.ledgers_missing(root) && self.health.refusal(root).is_none() {
                self.open_ledger(root, true);
            }
        }
        // The walk reads the segments' indexes again too (their descriptors were forgotten with the root's).
        if let Err(e) = self.refresh() {
            self.stats.record_error(format!("rebuilding the index after a storage directory came back: {e}"));
            return;
        }
        // What went with the directory went without the ledger's knowledge:
        // counted again from the index the walk just rebuilt.
        for root in 0..self.layout.roots().len() {
            self.recount_ledger(root);
        }
    }
}
