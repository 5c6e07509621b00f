//! Rebuilding the index from the directory tree: in the opening thread, or
//! in the background for very large stores (100k chunks take seconds cold),
//! while the store already serves.
//!
//! During a background scan `get` and `probe` work as always (they look at
//! the file, not the index); only index answers (`contains`, `len`,
//! `used_bytes`, eviction) are incomplete: an unknown key reads as absent.
//! What the scan finds is merged by its modification time, without reviving
//! a chunk removed while it ran (`ChunkIndex::merge_scanned`). The walk covers
//! every namespace directory under the roots (decision 0053).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::disk::files;
use crate::disk::index::{epoch_ns, ChunkIndex, Found, NsId, OWN};
use crate::disk::layout::{is_shard_name, parse_chunk_name, Layout, TEMP_PREFIX};
use crate::disk::writers;
use crate::error::{EngineError, Result};
use crate::faults::SharedFaults;
use crate::wait::{deadline_after, wait_until};

/// Temporary files whose inode changed longer ago than this belong to a dead
/// writer (also when their writer's lock cannot tell, e.g. without flock).
const STALE_TEMP_AGE: Duration = Duration::from_secs(600);

/// Chunks on disk, oldest modification first: this store's namespace and
/// every other namespace directory under its roots (their bytes count against
/// the capacity, decision 0053). Fillers carry the Unix epoch as their
/// modification time (`files::mark_filler`): they sort first, i.e. least
/// recently used. Temporary files of dead writers (lock released, or too old)
/// are removed on the way. `stop` ends the walk early (the store is closing).
///
/// Only real directories are entered (the entry's type, not followed) and
/// only `<32 hex>.kvc` regular files in the shard their name maps to are
/// chunks: nothing else under a root is ever counted or evicted.
pub fn collect(layout: &Layout, stop: &AtomicBool) -> Result<Vec<Found>> {
    let now = SystemTime::now();
    let mut found: Vec<Found> = Vec::new();
    for (root, root_dir) in layout.roots().iter().enumerate() {
        let mut namespaces = vec![(OWN, layout.ns_dirs()[root].clone())];
        match layout.other_namespace_dirs(root) {
            Ok(Some(others)) => namespaces.extend(others),
            // A root that went away holds nothing now (`store::recovery`).
            Ok(None) => continue,
            Err(e) => return Err(EngineError::io(format!("scanning {}", root_dir.display()), e)),
        }
        // Whether a temporary file's owner holds a live lease: asked once per owner and walk.
        let mut owners: std::collections::HashMap<u64, bool> = std::collections::HashMap::new();
        let mut owner_live = |id: u64| *owners.entry(id).or_insert_with(|| writers::is_live(root_dir, id));
        for (ns, ns_dir) in namespaces {
            if stop.load(Ordering::Relaxed) {
                return Ok(Vec::new());
            }
            match collect_namespace(ns, &ns_dir, now, stop, &mut owner_live, &mut found) {
                Ok(()) => {}
                // Another namespace's directory that cannot be read holds
                // nothing this store could evict: skipped.
                Err(_) if ns != OWN => {}
                Err(e) => return Err(e),
            }
        }
    }
    if stop.load(Ordering::Relaxed) {
        return Ok(Vec::new());
    }
    found.sort_unstable_by_key(|f| (f.modified, f.ns, f.hash));
    Ok(found)
}

fn collect_namespace(
    ns: NsId,
    ns_dir: &Path,
    now: SystemTime,
    stop: &AtomicBool,
    owner_live: &mut dyn FnMut(u64) -> bool,
    found: &mut Vec<Found>,
) -> Result<()> {
    let shards = match std::fs::read_dir(ns_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(EngineError::io(format!("scanning {}", ns_dir.display()), e)),
    };
    for shard in shards.flatten() {
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let shard_name = shard.file_name();
        let Some(shard_name) = shard_name.to_str() else { continue };
        if !is_shard_name(shard_name) || !shard.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        let dir = shard.path();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(EngineError::io(format!("scanning {}", dir.display()), e)),
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Ok(meta) = entry.metadata() else { continue };
            if name.starts_with(TEMP_PREFIX) {
                // ctime, not mtime: claiming an evicted file for reuse renames it
                // (fresh ctime) but keeps the old mtime until it is written.
                let changed =
                    SystemTime::UNIX_EPOCH + Duration::new(meta.ctime().max(0) as u64, meta.ctime_nsec().clamp(0, 999_999_999) as u32);
                let age = now.duration_since(changed).unwrap_or_default();
                if age > STALE_TEMP_AGE {
                    let _ = std::fs::remove_file(entry.path());
                } else {
                    files::remove_if_writer_gone(&entry.path(), name, owner_live);
                }
                continue;
            }
            // Only regular files with a chunk name; symlinks and strays are ignored.
            if !meta.file_type().is_file() {
                continue;
            }
            if let Some(hash) = parse_chunk_name(name) {
                if format!("{:02x}", (hash & 0xff) as u8) != shard_name {
                    continue; // not where its name puts it: no store would read it
                }
                let modified = meta.modified().unwrap_or(now);
                let filler = modified == SystemTime::UNIX_EPOCH;
                found.push(Found { ns, hash, file_len: meta.len(), modified: epoch_ns(modified), filler });
            }
        }
    }
    Ok(())
}

/// The index of what `collect` found, oldest least recent.
pub fn build_index(found: &[Found]) -> ChunkIndex {
    let mut index = ChunkIndex::default();
    index.begin_scan();
    index.merge_scanned(found);
    index
}

/// How the open-time scan went: chunks indexed, time taken, whether done.
#[derive(Clone, Debug, Default)]
pub struct ScanReport {
    pub done: bool,
    pub chunks: usize,
    pub time: Duration,
    pub error: Option<String>,
}

/// Progress of a background scan, for waiters.
#[derive(Default)]
pub struct ScanProgress {
    state: Mutex<ScanReport>,
    finished: Condvar,
    pub stop: AtomicBool,
}

impl ScanProgress {
    pub fn completed(report: ScanReport) -> Self {
        ScanProgress { state: Mutex::new(ScanReport { done: true, ..report }), ..Default::default() }
    }

    pub fn report(&self) -> ScanReport {
        self.state.lock().unwrap().clone()
    }

    /// Waits until the scan is done; false on timeout.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        wait_until(&self.state, &self.finished, deadline_after(timeout), |st| st.done.then_some(())).is_ok()
    }

    /// Walks the tree and merges what it found into `index` (which the
    /// caller put into scanning mode before the store started serving).
    pub fn run(&self, layout: &Layout, index: &Mutex<ChunkIndex>, faults: &SharedFaults) {
        let start = Instant::now();
        let found = collect(layout, &self.stop);
        let _held = faults.as_ref().and_then(|f| f.scan_hold());
        let (chunks, error) = match found {
            Ok(found) => {
                // This namespace's chunks: the others are counted, not served.
                let mut index = index.lock().unwrap();
                let before = index.len();
                index.merge_scanned(&found);
                (index.len().saturating_sub(before), None)
            }
            Err(e) => {
                // Nothing merged: the store goes on with what it indexes from now on.
                index.lock().unwrap().merge_scanned(&[]);
                (0, Some(e.to_string()))
            }
        };
        *self.state.lock().unwrap() = ScanReport { done: true, chunks, time: start.elapsed(), error };
        self.finished.notify_all();
    }
}
