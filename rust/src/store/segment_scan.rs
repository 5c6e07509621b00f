//! Reading segments (decision 0086) that other writers, or this store before
//! a restart, published: their indexes, looked at again when their
//! publication number moved; the slots punched since they were listed; and
//! the segments nobody can add a slot to any more and whose listed slots are
//! all punched, which are unlinked.
//!
//! Every namespace's segments are read at open and by the walks of a shared
//! directory (their chunks count against the capacity and may be evicted,
//! decision 0053); a lookup that misses reads only this namespace's.

use std::collections::{HashMap, HashSet};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use super::segments::{Aligned, Place, Seen, SegmentFile, Segments};
use crate::disk::dirfds::HeldDirs;
use crate::disk::index::{epoch_ns, ChunkRef, Found, NsId, OWN};
use crate::disk::layout::Layout;
use crate::disk::segment::{slot_offset, SegmentIndex, SegmentName, INDEX_BYTES, LOG_DIR, SLOTS_START};
use crate::disk::writers;

/// What one look at a root found to judge after reading the indexes.
#[derive(Default)]
struct Look {
    /// Per namespace read: its `log` directory.
    dirs: HashMap<NsId, PathBuf>,
    /// Segments whose index cannot be read (no publication landed, or none sound).
    unreadable: Vec<(NsId, SegmentName)>,
}

impl Segments {
    /// Reads the index of every segment on `root` that changed since the
    /// last look (all of them the first time): this namespace's, and with
    /// `all` every namespace's, unless the last look a miss asked for
    /// (`min_gap` > 0) is less than `min_gap` old. Returns the chunks found
    /// that this store had no place for and, with `all`, how many segments
    /// found emptied it unlinked. Blocking: a directory worker's or the
    /// refresh thread's.
    pub fn refresh(
        &self,
        held: &HeldDirs,
        layout: &Layout,
        root: usize,
        min_gap: Duration,
        all: bool,
    ) -> std::io::Result<(Vec<Found>, u64)> {
        let r = &self.roots[root];
        if !min_gap.is_zero() {
            // Only the looks a miss asks for are spaced out: a periodic one
            // (`min_gap` 0) must not make a miss right after it wait.
            let mut last = r.last_refresh.lock().unwrap();
            if last.is_some_and(|t| t.elapsed() < min_gap) {
                return Ok((Vec::new(), 0));
            }
            *last = Some(Instant::now());
        }
        let mut look = Look::default();
        look.dirs.insert(OWN, r.dir.clone());
        if all {
            match layout.other_namespace_dirs(root)? {
                Some(others) => look.dirs.extend(others.into_iter().map(|(ns, dir)| (ns, dir.join(LOG_DIR)))),
                None => return Ok((Vec::new(), 0)),
            }
        }
        let mut found = Vec::new();
        let mut buf = Aligned::new(2 * INDEX_BYTES);
        for (&ns, dir) in &look.dirs {
            match self.read_dir_of(held, root, ns, dir, &mut buf, &mut found, &mut look.unreadable) {
                Ok(()) => {}
                // Another namespace's segments that cannot be read hold nothing
                // this store could evict (as its chunk files, `scan::collect`).
                Err(_) if ns != OWN => {}
                Err(e) => return Err(e),
            }
        }
        let unlinked = if all { self.unlink_emptied(held, root, &look) } else { 0 };
        Ok((found, unlinked))
    }

    /// One namespace's `log` directory: its segments' indexes that moved.
    #[allow(clippy::too_many_arguments)]
    fn read_dir_of(
        &self,
        held: &HeldDirs,
        root: usize,
        ns: NsId,
        dir: &Path,
        buf: &mut Aligned,
        found: &mut Vec<Found>,
        unreadable: &mut Vec<(NsId, SegmentName)>,
    ) -> std::io::Result<()> {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut listed = HashSet::new();
        for entry in entries {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().and_then(SegmentName::parse) else { continue };
            listed.insert(name);
            let file = match self.file(held, root, ns, dir, name) {
                Ok(f) => f,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue, // unlinked meanwhile
                Err(e) => return Err(e),
            };
            // SAFETY: `buf` holds 2 * INDEX_BYTES bytes and lives until the call returns.
            let n = unsafe { libc::pread(file.fd(), buf.ptr as *mut libc::c_void, 2 * INDEX_BYTES, 0) };
            let index = (n == (2 * INDEX_BYTES) as isize).then(|| SegmentIndex::current(buf.bytes())).flatten();
            // Not one publication yet (or no sound copy): lists nothing.
            let Some(index) = index else {
                unreadable.push((ns, name));
                continue;
            };
            if index.slot_bytes != name.slot_bytes {
                continue; // not what its name says: never trusted
            }
            let prior = self.roots[root].seen.lock().unwrap().get(&(ns, name)).copied();
            if prior.is_some_and(|s| s.seq >= index.seq) {
                continue;
            }
            // The first read here: its slots may have been punched since they
            // were listed (evicted by anyone), so only those still holding
            // bytes count, ranked by the segment's last change. A later read:
            // a slot listed since was written a moment ago.
            let (data, modified) = match prior {
                None => (data_extents(file.fd()), modified_ns(file.fd())),
                Some(_) => (None, epoch_ns(SystemTime::now())),
            };
            let mut seen: Seen = prior.unwrap_or_default();
            seen.seq = index.seq;
            seen.sealed = index.sealed;
            {
                let mut places = self.places.lock().unwrap();
                for (slot, hash) in index.listed() {
                    if seen.has(slot) {
                        continue; // placed once already: evicted since, or still placed
                    }
                    seen.mark(slot);
                    if data.as_ref().is_some_and(|d| !holds_data(d, slot_offset(slot, name.slot_bytes))) {
                        continue;
                    }
                    if let std::collections::hash_map::Entry::Vacant(v) = places.entry(ChunkRef { ns, hash }) {
                        v.insert(Place { root, file: file.clone(), slot });
                        found.push(Found { ns, hash, file_len: name.slot_bytes, modified, filler: false });
                    }
                }
            }
            self.roots[root].seen.lock().unwrap().insert((ns, name), seen);
        }
        // Segments unlinked since (whoever emptied them): forgotten here too.
        let r = &self.roots[root];
        r.seen.lock().unwrap().retain(|(n, name), _| *n != ns || listed.contains(name));
        r.files.lock().unwrap().retain(|(n, name), _| *n != ns || listed.contains(name));
        Ok(())
    }

    /// Unlinks the segments of `root` that no writer adds a slot to any more
    /// (sealed, or their writer's lease is dead) and of which this store knows
    /// no chunk: every slot their index lists was punched (evicted, by this
    /// store or one whose punch a read here found) or never held a sound
    /// chunk. A segment whose writer died before its first publication goes
    /// too. A store still holding one open reads holes in it (misses).
    fn unlink_emptied(&self, held: &HeldDirs, root: usize, look: &Look) -> u64 {
        let r = &self.roots[root];
        let mut in_use: HashSet<(NsId, SegmentName)> = HashSet::new();
        for p in self.places.lock().unwrap().values().filter(|p| p.root == root) {
            in_use.insert((p.file.ns, p.file.name));
        }
        let candidates: Vec<((NsId, SegmentName), bool)> = {
            let seen = r.seen.lock().unwrap();
            let emptied = seen.iter().filter(|(k, _)| look.dirs.contains_key(&k.0) && !in_use.contains(k)).map(|(k, s)| (*k, s.sealed));
            emptied.chain(look.unreadable.iter().map(|k| (*k, false))).collect()
        };
        let (mut live, mut unlinked): (HashMap<u64, bool>, u64) = (HashMap::new(), 0);
        for ((ns, name), sealed) in candidates {
            // This store's own unsealed segments are being written (its lease is live).
            if !sealed && (name.lease == self.lease || *live.entry(name.lease).or_insert_with(|| writers::is_live(&r.root_dir, name.lease)))
            {
                continue;
            }
            match held.unlink(&look.dirs[&ns].join(name.file_name())) {
                Ok(()) => unlinked += 1,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(_) => continue,
            }
            r.seen.lock().unwrap().remove(&(ns, name));
            r.files.lock().unwrap().remove(&(ns, name));
        }
        unlinked
    }

    /// A held descriptor of segment `name` of namespace `ns` on `root`, opened on first use.
    fn file(&self, held: &HeldDirs, root: usize, ns: NsId, dir: &Path, name: SegmentName) -> std::io::Result<std::sync::Arc<SegmentFile>> {
        if let Some(f) = self.roots[root].files.lock().unwrap().get(&(ns, name)) {
            return Ok(f.clone());
        }
        let fd = held.open(&dir.join(name.file_name()), self.flags(root), 0)?;
        // SAFETY: `open` returned a descriptor this function owns from here on.
        let file = std::sync::Arc::new(SegmentFile { ns, name, fd: unsafe { OwnedFd::from_raw_fd(fd) } });
        self.remember_file(root, file.clone());
        Ok(file)
    }

    /// Frees a slot's bytes (eviction): the slot reads as zeros from now on,
    /// on every node. A slot punched already (another store evicted it
    /// first) is NotFound, as a chunk file unlinked already is: its bytes
    /// left the capacity ledger with that store's punch, not twice.
    pub fn punch(&self, place: &Place) -> std::io::Result<()> {
        let base = place.file_base();
        if !slot_holds_data(place.file.fd(), base) {
            return Err(std::io::Error::from_raw_os_error(libc::ENOENT));
        }
        let len = place.file.name.slot_bytes as libc::off_t;
        // SAFETY: fallocate takes no pointer; the descriptor is open while `place` holds it.
        let rc =
            unsafe { libc::fallocate(place.file.fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, base as libc::off_t, len) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// The byte ranges of `fd` past the index copies that hold data
/// (`SEEK_DATA`/`SEEK_HOLE`: two calls per range), or None where the
/// filesystem cannot tell (then every slot counts as holding data).
fn data_extents(fd: RawFd) -> Option<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut at = SLOTS_START as libc::off_t;
    loop {
        // SAFETY: lseek takes no pointer; `fd` is open for the call.
        let start = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if start < 0 {
            return match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::ENXIO) => Some(out), // no data past `at`
                _ => None,
            };
        }
        // SAFETY: as above.
        let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
        if end <= start {
            return None;
        }
        out.push((start as u64, end as u64));
        at = end;
    }
}

fn holds_data(extents: &[(u64, u64)], offset: u64) -> bool {
    extents.iter().any(|&(start, end)| start <= offset && offset < end)
}

/// Whether the slot starting at `base` still holds its bytes (its header
/// block is no hole). True where the filesystem cannot tell.
fn slot_holds_data(fd: RawFd, base: u64) -> bool {
    // SAFETY: lseek takes no pointer; `fd` is open for the call.
    let at = unsafe { libc::lseek(fd, base as libc::off_t, libc::SEEK_DATA) };
    if at < 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
    }
    at as u64 == base
}

/// The file's modification time: when its writer last published (or a
/// slot of it was punched), nanoseconds since the Unix epoch.
fn modified_ns(fd: RawFd) -> u64 {
    // SAFETY: `st` is plain data fstat fills; `fd` is open for the call.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return epoch_ns(SystemTime::now());
    }
    (st.st_mtime as u64).saturating_mul(1_000_000_000).saturating_add(st.st_mtime_nsec as u64)
}
