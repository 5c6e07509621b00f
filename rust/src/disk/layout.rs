//! Where chunks live: `<root>/<namespace-hex>/<hh>/<keyhash-hex>.kvc`.
//!
//! File names derive only from the 128-bit key hash, so a key can never name
//! a path outside the root. The namespace fingerprint is part of the path (and
//! of every header), so stores of different models never see each other's
//! chunks. A key always maps to the same root, so every process sharing the
//! directories finds a chunk without an index exchange.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};
use crate::disk::format::Fingerprint;

pub const CHUNK_SUFFIX: &str = ".kvc";
pub const TEMP_PREFIX: &str = ".tmp-";

pub struct Layout {
    ns_dirs: Vec<PathBuf>,
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
        for configured in roots {
            let root = resolve_root(configured, perms)?;
            let ns_dir = root.join(&ns_hex);
            for sub in 0..=255u8 {
                let d = ns_dir.join(format!("{sub:02x}"));
                if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(perms.dir_mode).create(&d) {
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
        Ok(Layout { ns_dirs })
    }

    pub fn ns_dirs(&self) -> &[PathBuf] {
        &self.ns_dirs
    }

    pub fn root_of(&self, hash: u128) -> usize {
        // Upper bits pick the root, lower bits the subdirectory: independent stripes.
        ((hash >> 64) as u64 % self.ns_dirs.len() as u64) as usize
    }

    pub fn shard_dir(&self, hash: u128) -> PathBuf {
        self.ns_dirs[self.root_of(hash)].join(format!("{:02x}", (hash & 0xff) as u8))
    }

    pub fn chunk_path(&self, hash: u128) -> PathBuf {
        self.shard_dir(hash).join(format!("{hash:032x}{CHUNK_SUFFIX}"))
    }
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

/// Creates a configured storage directory if missing and returns its real
/// path: a symlinked root (`/data/kv -> /mnt/nvme0/kv`) is what an operator
/// means and is followed here, once; the store then works under the resolved
/// path, where every directory below is checked to be real
/// (`require_real_dir`) and chunk opens never follow symlinks.
pub fn resolve_root(root: &Path, perms: &Permissions) -> Result<PathBuf> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(perms.dir_mode)
        .create(root)
        .map_err(|e| EngineError::io(format!("creating storage directory {}", root.display()), e))?;
    let resolved = std::fs::canonicalize(root).map_err(|e| EngineError::io(format!("resolving storage directory {}", root.display()), e))?;
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
