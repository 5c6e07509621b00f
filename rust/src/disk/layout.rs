//! Where chunks live: `<root>/<namespace-hex>/<hh>/<keyhash-hex>.kvc`.
//!
//! File names derive only from the 128-bit key hash, so a key can never name
//! a path outside the root. The namespace fingerprint is part of the path (and
//! of every header), so stores of different models never see each other's
//! chunks. A key always maps to the same root, so every process sharing the
//! directories finds a chunk without an index exchange.
//!
//! Other namespaces' directories under the same roots (another model, dtype,
//! override, or an older configuration of this one) are known by id
//! (`other_namespace`): their chunks count against this store's capacity and
//! may be evicted, never read (decision 0053).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::disk::format::Fingerprint;
use crate::disk::index::{ChunkRef, NsId, OWN};
use crate::error::{EngineError, Result};

pub const CHUNK_SUFFIX: &str = ".kvc";
pub const TEMP_PREFIX: &str = ".tmp-";

pub struct Layout {
    roots: Vec<PathBuf>,
    ns_dirs: Vec<PathBuf>,
    ns_hex: String,
    /// The `NAMESPACE` label's text (what this namespace holds, for people).
    label: String,
    /// Other namespace directories found under the roots: (root, directory);
    /// the id of one is its position + 1 (`OWN` is 0). Only grows.
    others: Mutex<Vec<(usize, PathBuf)>>,
}

/// Characters of a namespace directory's name (the fingerprint in hex).
const NS_HEX_LEN: usize = 32;

/// Whether `name` is a namespace directory's name (32 lowercase hex digits).
pub fn is_namespace_name(name: &str) -> bool {
    name.len() == NS_HEX_LEN && name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether `name` is a shard directory's name (2 lowercase hex digits).
pub fn is_shard_name(name: &str) -> bool {
    name.len() == 2 && name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Modes of the directories and chunk files a store creates, unless configured.
pub const DEFAULT_DIR_MODE: u32 = 0o700;
pub const DEFAULT_FILE_MODE: u32 = 0o600;

#[derive(Clone, Copy, Debug)]
pub struct Permissions {
    pub dir_mode: u32,
    pub file_mode: u32,
    /// Accept a root that is world-writable or owned by another user.
    pub allow_insecure_root: bool,
}

impl Default for Permissions {
    fn default() -> Self {
        Permissions { dir_mode: DEFAULT_DIR_MODE, file_mode: DEFAULT_FILE_MODE, allow_insecure_root: false }
    }
}

impl Layout {
    /// Creates (if needed) the namespace directories under each root.
    pub fn open(roots: &[PathBuf], namespace: &Fingerprint, namespace_text: &str, perms: &Permissions) -> Result<Self> {
        if roots.is_empty() {
            return Err(EngineError::invalid("at least one storage directory is required"));
        }
        let ns_hex = hex(namespace);
        let mut ns_dirs = Vec::with_capacity(roots.len());
        let mut resolved = Vec::with_capacity(roots.len());
        for configured in roots {
            let root = resolve_root(configured, perms)?;
            resolved.push(root.clone());
            let ns_dir = root.join(&ns_hex);
            for sub in 0..=255u8 {
                let d = ns_dir.join(format!("{sub:02x}"));
                if let Err(e) = create_dir_shared(&d, perms.dir_mode) {
                    return Err(EngineError::io(format!("creating {}", d.display()), e));
                }
                require_real_dir(&d)?;
            }
            require_real_dir(&ns_dir)?;
            // A human-readable label of what this namespace holds.
            let label = ns_dir.join("NAMESPACE");
            if !label.exists() {
                let _ = std::fs::write(&label, namespace_text);
                let _ = std::fs::set_permissions(&label, std::fs::Permissions::from_mode(perms.file_mode));
            }
            ns_dirs.push(ns_dir);
        }
        Ok(Layout { roots: resolved, ns_dirs, ns_hex, label: namespace_text.to_owned(), others: Mutex::new(Vec::new()) })
    }

    /// Re-creates this namespace's directory and its shards under root `root`
    /// where they went missing (a cleanup job emptied the root), never the
    /// root itself nor anything above it: a missing root stays missing (it
    /// may be an unmounted filesystem's mountpoint). True when the namespace
    /// directory itself had to be created.
    pub fn ensure_tree(&self, root: usize, perms: &Permissions) -> std::io::Result<bool> {
        let ns_dir = &self.ns_dirs[root];
        let created = match std::fs::symlink_metadata(ns_dir) {
            Ok(m) if m.is_dir() => false,
            Ok(_) => return Err(std::io::Error::other(format!("{} is not a directory", ns_dir.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                create_dir_in(ns_dir, perms.dir_mode)?;
                true
            }
            Err(e) => return Err(e),
        };
        for d in self.shard_dirs(root) {
            create_dir_in(&d, perms.dir_mode)?;
            require_real_dir(&d).map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        let label = ns_dir.join("NAMESPACE");
        if created && !label.exists() {
            let _ = std::fs::write(&label, &self.label);
            let _ = std::fs::set_permissions(&label, std::fs::Permissions::from_mode(perms.file_mode));
        }
        Ok(created)
    }

    pub fn ns_dirs(&self) -> &[PathBuf] {
        &self.ns_dirs
    }

    /// The storage roots (resolved), in configuration order.
    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// The other namespaces' directories under root `root` (real directories
    /// with a namespace's name, never followed), with their ids; None when
    /// the root itself is gone. The walks and the segment reads list them so.
    pub fn other_namespace_dirs(&self, root: usize) -> std::io::Result<Option<Vec<(NsId, PathBuf)>>> {
        let entries = match std::fs::read_dir(&self.roots[root]) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
            if is_dir && is_namespace_name(name) && name != self.ns_hex {
                out.push((self.namespace_id(root, name), entry.path()));
            }
        }
        Ok(Some(out))
    }

    /// The id of the namespace directory `name` under root `root`: `OWN` for
    /// this store's, else an id for another namespace (the same on every call).
    pub fn namespace_id(&self, root: usize, name: &str) -> NsId {
        if name == self.ns_hex {
            return OWN;
        }
        let dir = self.roots[root].join(name);
        let mut others = self.others.lock().unwrap();
        let at = others.iter().position(|(r, d)| *r == root && *d == dir).unwrap_or_else(|| {
            others.push((root, dir));
            others.len() - 1
        });
        at as NsId + 1
    }

    /// The namespace directory of `ns` on `root` (for `OWN`, on the root of its chunks).
    pub fn ns_dir_of(&self, ns: NsId, root: usize) -> PathBuf {
        if ns == OWN {
            return self.ns_dirs[root].clone();
        }
        self.others.lock().unwrap()[ns as usize - 1].1.clone()
    }

    /// The root a chunk of any namespace lives on.
    pub fn root_of_ref(&self, c: ChunkRef) -> usize {
        if c.ns == OWN {
            return self.root_of(c.hash);
        }
        self.others.lock().unwrap()[c.ns as usize - 1].0
    }

    /// The file of a chunk of any namespace.
    pub fn chunk_path_of(&self, c: ChunkRef) -> PathBuf {
        if c.ns == OWN {
            return self.chunk_path(c.hash);
        }
        let dir = self.ns_dir_of(c.ns, 0);
        dir.join(format!("{:02x}", (c.hash & 0xff) as u8)).join(format!("{:032x}{CHUNK_SUFFIX}", c.hash))
    }

    /// What a namespace holds, for people: the first line of its `NAMESPACE`
    /// label (cut to 120 characters), else its directory.
    pub fn describe(&self, ns: NsId) -> String {
        let dir = self.ns_dir_of(ns, 0);
        let label = std::fs::read_to_string(dir.join("NAMESPACE")).ok().and_then(|t| t.lines().next().map(str::to_owned));
        match label {
            Some(l) if !l.trim().is_empty() => {
                let l: String = l.chars().take(120).collect();
                format!("{l} ({})", dir.display())
            }
            _ => dir.display().to_string(),
        }
    }

    pub fn root_of(&self, hash: u128) -> usize {
        // Upper bits pick the root, lower bits the subdirectory: independent stripes.
        ((hash >> 64) as u64 % self.ns_dirs.len() as u64) as usize
    }

    pub fn shard_dir(&self, hash: u128) -> PathBuf {
        shard_in(&self.ns_dirs[self.root_of(hash)], (hash & 0xff) as u8)
    }

    /// Every shard directory of this namespace under root `root`.
    pub fn shard_dirs(&self, root: usize) -> impl Iterator<Item = PathBuf> + '_ {
        (0..=255u8).map(move |shard| shard_in(&self.ns_dirs[root], shard))
    }

    pub fn chunk_path(&self, hash: u128) -> PathBuf {
        self.shard_dir(hash).join(format!("{hash:032x}{CHUNK_SUFFIX}"))
    }
}

/// A shard's directory in a namespace directory: the chunk hash's low byte, 2 hex digits.
fn shard_in(ns_dir: &Path, shard: u8) -> PathBuf {
    ns_dir.join(format!("{shard:02x}"))
}

/// Parses `<32 hex>.kvc` back into a key hash.
pub fn parse_chunk_name(name: &str) -> Option<u128> {
    let stem = name.strip_suffix(CHUNK_SUFFIX)?;
    if stem.len() != 32 {
        return None;
    }
    u128::from_str_radix(stem, 16).ok()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn cstring(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| EngineError::invalid(format!("path contains NUL: {}", path.display())))
}

/// Chunk opens refuse symlinks only in their last component (O_NOFOLLOW), so
/// the directories above them must not be symlinks either.
fn require_real_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| EngineError::io(format!("inspecting {}", dir.display()), e))?;
    if !meta.is_dir() {
        return Err(EngineError::invalid(format!(
            "{} inside the store is not a directory (a symlink there is never followed); remove it",
            dir.display()
        )));
    }
    Ok(())
}

/// How long creating a directory keeps retrying a mkdir that says EEXIST for a
/// directory this client cannot see, or ESTALE while another node creates it.
const DIR_CREATE_WAIT: Duration = Duration::from_secs(2);

/// Creates `dir` and its missing parents, as `create_dir_all` does, but safe
/// against other nodes creating the same directories at once on a shared
/// filesystem. `create_dir_all` takes EEXIST as done when the path is then a
/// directory, and fails otherwise. On GlusterFS two clients that mkdir one name
/// at once can both get EEXIST while neither creates it: the name is then in no
/// listing, on neither mount, and a new mkdir succeeds (measured on the test
/// volume with client caching: ~1 in 100 concurrent mkdirs). The CI saw two
/// nodes opening one fresh store fail so. A mkdir racing another client's mkdir
/// of the same name can also fail with ESTALE (the client's cached handle of the
/// name went stale under it; seen once in CI with two nodes opening one fresh
/// store). Here an EEXIST or ESTALE for a path that is not there is retried until
/// `DIR_CREATE_WAIT`; a non-directory in the way is still an error at once.
pub(crate) fn create_dir_shared(dir: &Path, mode: u32) -> std::io::Result<()> {
    create_dir_shared_with(dir, DIR_CREATE_WAIT, &|p| std::fs::DirBuilder::new().mode(mode).create(p))
}

/// `create_dir_shared` for a directory whose parent must exist already: a
/// missing parent is an error (ENOENT), never created.
pub(crate) fn create_dir_in(dir: &Path, mode: u32) -> std::io::Result<()> {
    create_dir_shared_with_parents(dir, DIR_CREATE_WAIT, false, &|p| std::fs::DirBuilder::new().mode(mode).create(p))
}

/// `create_dir_shared` with the wait and the mkdir call as parameters, for tests.
fn create_dir_shared_with(dir: &Path, wait: Duration, mkdir: &dyn Fn(&Path) -> std::io::Result<()>) -> std::io::Result<()> {
    create_dir_shared_with_parents(dir, wait, true, mkdir)
}

fn create_dir_shared_with_parents(
    dir: &Path,
    wait: Duration,
    parents: bool,
    mkdir: &dyn Fn(&Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    if dir.as_os_str().is_empty() {
        return Ok(());
    }
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_millis(1);
    loop {
        let exists = match mkdir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match dir.parent() {
                Some(parent) if parents && Instant::now() < deadline => {
                    create_dir_shared_with(parent, wait, mkdir)?;
                    continue;
                }
                _ => return Err(e),
            },
            Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST | libc::ESTALE)) => e,
            Err(e) => return Err(e),
        };
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => return Ok(()),
            Ok(_) => return Err(exists),
            Err(e) if Instant::now() >= deadline => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("mkdir keeps failing ({exists}), and after {wait:?} the directory is still not there: {e}"),
                ))
            }
            Err(_) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
        }
    }
}

/// Creates a configured storage directory if missing and returns its real
/// path: a symlinked root (`/data/kv -> /mnt/nvme0/kv`) is what an operator
/// means and is followed here, once; the store then works under the resolved
/// path, where every directory below is checked to be real
/// (`require_real_dir`) and chunk opens never follow symlinks.
pub fn resolve_root(root: &Path, perms: &Permissions) -> Result<PathBuf> {
    create_dir_shared(root, perms.dir_mode).map_err(|e| EngineError::io(format!("creating storage directory {}", root.display()), e))?;
    let resolved =
        std::fs::canonicalize(root).map_err(|e| EngineError::io(format!("resolving storage directory {}", root.display()), e))?;
    check_root(&resolved, perms)?;
    Ok(resolved)
}

/// What a store refuses about an existing storage root (not a directory,
/// another user's, world-writable), without creating anything: also run by the
/// vLLM integration before a model loads (`_core.check_storage_dir`).
pub fn check_root(root: &Path, perms: &Permissions) -> Result<()> {
    let meta = std::fs::symlink_metadata(root).map_err(|e| EngineError::io(format!("inspecting {}", root.display()), e))?;
    if !meta.is_dir() {
        return Err(EngineError::invalid(format!("storage path {} is not a directory", root.display())));
    }
    if perms.allow_insecure_root {
        return Ok(());
    }
    // SAFETY: geteuid takes no argument and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(EngineError::invalid(format!(
            "storage directory {} is owned by uid {}, not by this process (uid {me}); set allow_insecure_root (BlockStore keyword, vLLM key) to accept it",
            root.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o002 != 0 {
        return Err(EngineError::invalid(format!(
            "storage directory {} is world-writable; anyone could plant chunks (chmod o-w, or set allow_insecure_root: BlockStore keyword, vLLM key)",
            root.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const WAIT: Duration = Duration::from_millis(200);

    /// The filesystem, except that the first `spurious` mkdirs of `dir` fail
    /// with EEXIST without creating anything (what GlusterFS did).
    fn spurious_eexist(dir: &Path, spurious: u32, test: impl FnOnce(&dyn Fn(&Path) -> std::io::Result<()>)) -> u32 {
        spurious_errno(dir, libc::EEXIST, spurious, test)
    }

    /// The filesystem, except that the first `spurious` mkdirs of `dir` fail
    /// with `errno` without creating anything.
    fn spurious_errno(dir: &Path, errno: i32, spurious: u32, test: impl FnOnce(&dyn Fn(&Path) -> std::io::Result<()>)) -> u32 {
        let calls = Cell::new(0);
        let mkdir = |p: &Path| {
            if p == dir {
                calls.set(calls.get() + 1);
                if calls.get() <= spurious {
                    return Err(std::io::Error::from_raw_os_error(errno));
                }
            }
            std::fs::create_dir(p)
        };
        test(&mkdir);
        calls.get()
    }

    #[test]
    fn creates_missing_parents_and_accepts_an_existing_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("a/b/c");
        create_dir_shared(&d, 0o700).unwrap();
        assert!(d.is_dir());
        create_dir_shared(&d, 0o700).unwrap();
    }

    #[test]
    fn a_spurious_eexist_is_retried_until_the_directory_exists() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("00");
        let calls = spurious_eexist(&d, 3, |mkdir| create_dir_shared_with(&d, WAIT, mkdir).unwrap());
        assert_eq!(calls, 4);
        assert!(d.is_dir());
    }

    #[test]
    fn a_spurious_estale_is_retried_until_the_directory_exists() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("00");
        let calls = spurious_errno(&d, libc::ESTALE, 2, |mkdir| create_dir_shared_with(&d, WAIT, mkdir).unwrap());
        assert_eq!(calls, 3);
        assert!(d.is_dir());
    }

    #[test]
    fn an_eexist_that_never_clears_fails_after_the_wait_and_says_so() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("00");
        let started = Instant::now();
        spurious_eexist(&d, u32::MAX, |mkdir| {
            let err = create_dir_shared_with(&d, WAIT, mkdir).unwrap_err();
            assert!(err.to_string().contains("still not there"), "{err}");
        });
        assert!(started.elapsed() >= WAIT);
    }

    #[test]
    fn a_file_in_the_way_is_an_error_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("00");
        std::fs::write(&d, b"x").unwrap();
        let err = create_dir_shared(&d, 0o700).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EEXIST));
    }

    #[test]
    fn threads_creating_one_tree_at_once_all_succeed() {
        for _ in 0..20 {
            let tmp = tempfile::tempdir().unwrap();
            let d = tmp.path().join("ns/00");
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| create_dir_shared(&d, 0o700).unwrap());
                }
            });
            assert!(d.is_dir());
        }
    }
}
