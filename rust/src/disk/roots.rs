//! Which directory a storage root is: its identity at open and now, so that a
//! store whose root was deleted, moved away, replaced or unmounted notices it
//! and uses a directory back at that path only when it is the same place.
//!
//! A root re-created on the same filesystem (a new inode) is the same place:
//! an operator who removed the cache and made the directory again. So is a
//! filesystem mounted again at a root that was its mountpoint (a network or
//! FUSE filesystem gets a new device number on each mount). What is *not*:
//! a root that was a mountpoint and is now a plain directory of the
//! filesystem above it (the mount went away: writing there would fill the
//! wrong disk), or a root now on a filesystem of another type.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::disk::layout::cstring;

/// statfs `f_type`s of network and FUSE filesystems: where every file
/// operation is a round trip to another machine (the capacity ledger bypasses
/// the page cache there; new chunks go into segment files by default).
const NETWORK_FS: [i64; 9] = [
    0x6573_5546,           // FUSE (GlusterFS, CephFS-fuse, ...)
    0x6969,                // NFS
    0xff53_4d42u32 as i64, // CIFS
    0xfe53_4d42u32 as i64, // SMB2
    0x00c3_6400,           // Ceph
    0x0bd0_0bd0,           // Lustre
    0x4750_4653,           // GPFS
    0x5346_414f,           // AFS
    0x0102_1997,           // 9P
];

/// Whether `root` is on a network or FUSE filesystem.
pub fn on_network_fs(root: &Path) -> bool {
    RootIdentity::of(root).is_ok_and(|id| NETWORK_FS.contains(&id.fs_type))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootIdentity {
    pub dev: u64,
    pub ino: u64,
    /// `statfs` `f_type`: ext4, xfs, tmpfs, fuse...
    pub fs_type: i64,
    /// On another device than its parent: the root is a mountpoint.
    pub mount_root: bool,
}

impl RootIdentity {
    /// The identity of the directory at `root` now. ENOENT when nothing is
    /// there; an error too when it is not a real directory (a symlink there is
    /// never followed: the root was resolved once, at open).
    pub fn of(root: &Path) -> std::io::Result<Self> {
        let meta = std::fs::symlink_metadata(root)?;
        if !meta.is_dir() {
            return Err(std::io::Error::other(format!("{} is no longer a directory", root.display())));
        }
        let parent_dev = match root.parent() {
            Some(p) if !p.as_os_str().is_empty() => std::fs::metadata(p)?.dev(),
            _ => meta.dev(),
        };
        let c = cstring(root).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: statfs is plain data, for which all-zero bytes are a valid value.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a NUL-terminated path and `st` a writable statfs; both live across the
        // call.
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(RootIdentity { dev: meta.dev(), ino: meta.ino(), fs_type: st.f_type as i64, mount_root: meta.dev() != parent_dev })
    }

    /// Whether `now` (what is at the root's path now) is the place this
    /// identity was: the same filesystem, or one of the same type mounted
    /// the same way (a mountpoint still a mountpoint).
    pub fn same_place(&self, now: &RootIdentity) -> bool {
        self.dev == now.dev || (self.fs_type == now.fs_type && self.mount_root == now.mount_root)
    }

    /// Whether `now` is this very directory (not one made again at its path).
    pub fn same_directory(&self, now: &RootIdentity) -> bool {
        self.dev == now.dev && self.ino == now.ino
    }

    /// Why `now` is not this root's place, for the log.
    pub fn elsewhere(&self, now: &RootIdentity) -> String {
        if self.mount_root && !now.mount_root {
            "it was a mountpoint and is now a plain directory (its filesystem is unmounted)".into()
        } else if !self.mount_root && now.mount_root {
            "another filesystem is mounted there now".into()
        } else {
            format!("it is on a filesystem of another type now ({:#x}, was {:#x})", now.fs_type, self.fs_type)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(dev: u64, ino: u64, fs_type: i64, mount_root: bool) -> RootIdentity {
        RootIdentity { dev, ino, fs_type, mount_root }
    }

    #[test]
    fn a_directory_made_again_on_its_filesystem_is_the_same_place() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("kv");
        std::fs::create_dir(&root).unwrap();
        let before = RootIdentity::of(&root).unwrap();
        assert!(!before.mount_root);
        std::fs::remove_dir(&root).unwrap();
        assert_eq!(RootIdentity::of(&root).unwrap_err().kind(), std::io::ErrorKind::NotFound);
        std::fs::create_dir(&root).unwrap();
        let again = RootIdentity::of(&root).unwrap();
        assert!(before.same_place(&again));
        std::fs::write(tmp.path().join("f"), b"x").unwrap();
        assert!(RootIdentity::of(&tmp.path().join("f")).is_err(), "a file is no root");
    }

    #[test]
    fn an_unmounted_mountpoint_is_not_the_same_place_and_a_remount_is() {
        let mounted = id(40, 1, 0x6573_5546, true); // FUSE, its own device
        let mountpoint_left = id(8, 77, 0xef53, false); // ext4 below, the mount gone
        assert!(!mounted.same_place(&mountpoint_left));
        assert!(mounted.elsewhere(&mountpoint_left).contains("unmounted"));
        let remounted = id(41, 1, 0x6573_5546, true); // a new device number
        assert!(mounted.same_place(&remounted));
        // A subdirectory root whose filesystem changed type is elsewhere.
        let sub = id(8, 5, 0xef53, false);
        assert!(!sub.same_place(&id(9, 6, 0x0102_1994, false)));
        assert!(sub.same_place(&id(8, 6, 0xef53, false)));
    }
}
