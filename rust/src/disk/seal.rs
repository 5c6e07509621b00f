//! Keys and ciphers of sealed chunks (decision 0083): AES-256-GCM (ring) over
//! each frame of a chunk's payload, with keys derived per tenant.
//!
//! A key file holds 32 random bytes. From it, with HKDF-SHA256 (salt: a fixed
//! label), come: the key id (8 bytes, in every header it seals: which key
//! file), and per tenant a data key (32 bytes, info = label ‖ tenant) and a
//! tenant id (16 bytes, info = another label ‖ tenant). Tenant ids are keyed,
//! so a header does not tell a reader without the key which tenant wrote it.
//! Nothing here prints key bytes: no type holding them is `Debug`.
//!
//! Nonces: 96 random bits per write from the OS (`fresh_nonce`); frame `i` of
//! that write uses the nonce with `i` added into its last 32 bits (`frame_nonce`).

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};

use super::format::{AAD_BYTES, TAG_BYTES};
use crate::error::{EngineError, Result};

/// Bytes of a key file.
pub const KEY_FILE_BYTES: usize = 32;
/// Most bytes of a tenant.
pub const MAX_TENANT_BYTES: usize = 1024;
/// Tenants whose derived keys stay cached (least recently used leave first).
pub const TENANT_CACHE: usize = 1024;

const SALT: &[u8] = b"pykvcache chunk sealing v1";
const KEY_ID_INFO: &[u8] = b"pykvcache/v1/key-id";
const DATA_KEY_INFO: &[u8] = b"pykvcache/v1/data-key:";
const TENANT_ID_INFO: &[u8] = b"pykvcache/v1/tenant-id:";

/// An HKDF output length (ring's `KeyType`).
struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// One key file's secret: its HKDF pseudorandom key, and its id.
pub struct MasterKey {
    prk: hkdf::Prk,
    id: [u8; 8],
}

impl MasterKey {
    pub fn from_bytes(bytes: &[u8; KEY_FILE_BYTES]) -> Self {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SALT).extract(bytes);
        let mut id = [0u8; 8];
        expand(&prk, &[KEY_ID_INFO], &mut id);
        MasterKey { prk, id }
    }

    /// Reads a key file: a regular file of exactly `KEY_FILE_BYTES` bytes that
    /// neither group nor others may read or write. Each refusal names the path
    /// and the fix; none shows a byte of the file.
    pub fn load(path: &Path, what: &str) -> Result<Self> {
        let shown = path.display();
        // O_NONBLOCK: a FIFO planted at the path cannot hang the open.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| EngineError::io(format!("{what} {shown}: cannot open it"), e))?;
        let meta = file.metadata().map_err(|e| EngineError::io(format!("{what} {shown}: cannot stat it"), e))?;
        if !meta.file_type().is_file() {
            return Err(EngineError::invalid(format!("{what} {shown} is not a regular file; write one with `pykvcache keygen PATH`")));
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(EngineError::invalid(format!(
                "{what} {shown} has mode {mode:04o}: group or others may read or write it; run `chmod 600 {shown}`"
            )));
        }
        if meta.len() != KEY_FILE_BYTES as u64 {
            return Err(EngineError::invalid(format!(
                "{what} {shown} holds {} bytes, not {KEY_FILE_BYTES} raw bytes; write one with `pykvcache keygen PATH`",
                meta.len()
            )));
        }
        let mut bytes = [0u8; KEY_FILE_BYTES];
        let read = (&file).read_exact(&mut bytes);
        let key = read.map(|()| Self::from_bytes(&bytes));
        wipe(&mut bytes);
        key.map_err(|e| EngineError::io(format!("{what} {shown}: cannot read it"), e))
    }

    /// The key file's id (in every header it seals; derived, not secret).
    pub fn id(&self) -> [u8; 8] {
        self.id
    }

    fn tenant_key(&self, tenant: &[u8]) -> TenantKey {
        let mut data = [0u8; 32];
        expand(&self.prk, &[DATA_KEY_INFO, tenant], &mut data);
        let aead = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &data).expect("a 32-byte AES-256 key"));
        wipe(&mut data);
        let mut tenant_id = [0u8; 16];
        expand(&self.prk, &[TENANT_ID_INFO, tenant], &mut tenant_id);
        TenantKey { key_id: self.id, tenant_id, aead }
    }
}

fn expand(prk: &hkdf::Prk, info: &[&[u8]], out: &mut [u8]) {
    // Lengths here are at most 32 bytes, far below HKDF's 255 x 32.
    prk.expand(info, Len(out.len())).and_then(|okm| okm.fill(out)).expect("HKDF output of at most 32 bytes");
}

/// Overwrites key bytes before their memory is reused.
fn wipe(bytes: &mut [u8]) {
    for b in bytes.iter_mut() {
        // SAFETY: `b` is a valid, exclusive reference to one byte; the volatile write keeps the
        // compiler from dropping the store as dead.
        unsafe { std::ptr::write_volatile(b, 0) };
    }
}

/// A tenant's data key under one key file, with the ids its headers carry.
pub struct TenantKey {
    pub key_id: [u8; 8],
    pub tenant_id: [u8; 16],
    aead: LessSafeKey,
}

impl TenantKey {
    /// Seals `src` into `dst` (same length) as frame `frame` of a write with
    /// nonce `nonce`; returns its tag.
    pub fn seal_frame(&self, nonce: &[u8; 12], frame: u32, aad: &[u8; AAD_BYTES], src: &[u8], dst: &mut [u8]) -> [u8; TAG_BYTES] {
        dst.copy_from_slice(src);
        let nonce = Nonce::assume_unique_for_key(frame_nonce(nonce, frame));
        let tag = self.aead.seal_in_place_separate_tag(nonce, Aad::from(&aad[..]), dst).expect("a frame within GCM's length bound");
        tag.as_ref().try_into().expect("a 16-byte tag")
    }

    /// Opens frame `frame` in place; false when its tag does not verify
    /// (the bytes are then garbage).
    pub fn open_frame(&self, nonce: &[u8; 12], frame: u32, aad: &[u8; AAD_BYTES], tag: &[u8; TAG_BYTES], in_out: &mut [u8]) -> bool {
        let nonce = Nonce::assume_unique_for_key(frame_nonce(nonce, frame));
        self.aead.open_in_place_separate_tag(nonce, Aad::from(&aad[..]), Tag::from(*tag), in_out, 0..).is_ok()
    }
}

/// The nonce of frame `frame`: the write's nonce with `frame` added to its last
/// 32 bits (big-endian, wrapping). Frames of one write never share a nonce
/// (`format::MAX_FRAMES` is far below 2^32).
pub fn frame_nonce(nonce: &[u8; 12], frame: u32) -> [u8; 12] {
    let mut n = *nonce;
    let low = u32::from_be_bytes(n[8..].try_into().unwrap()).wrapping_add(frame);
    n[8..].copy_from_slice(&low.to_be_bytes());
    n
}

/// 96 random bits from the OS's CSPRNG (getrandom): the nonce of one write.
pub fn fresh_nonce() -> Result<[u8; 12]> {
    let mut nonce = [0u8; 12];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| EngineError::io("drawing a nonce from the OS random source", std::io::Error::other("getrandom failed")))?;
    Ok(nonce)
}

/// One tenant's keys: the current key file's (writes and reads) and the
/// previous one's (reads only).
pub struct TenantKeys {
    pub current: TenantKey,
    pub previous: Option<TenantKey>,
}

impl TenantKeys {
    /// The key that sealed a chunk whose header names `key_id` and
    /// `tenant_id`, if it is one of this tenant's.
    pub fn for_header(&self, key_id: &[u8; 8], tenant_id: &[u8; 16]) -> Option<&TenantKey> {
        std::iter::once(&self.current).chain(&self.previous).find(|k| &k.key_id == key_id && &k.tenant_id == tenant_id)
    }
}

/// Tenant → its keys and when they were last used (a counter).
type TenantCache = HashMap<Vec<u8>, (Arc<TenantKeys>, u64)>;

/// The key files of a store and the tenant keys derived from them so far.
pub struct KeyRing {
    current: MasterKey,
    previous: Option<MasterKey>,
    /// The cached tenants, and the use counter.
    cache: Mutex<(TenantCache, u64)>,
}

impl KeyRing {
    pub fn new(current: MasterKey, previous: Option<MasterKey>) -> Result<Self> {
        if previous.as_ref().is_some_and(|p| p.id == current.id) {
            return Err(EngineError::invalid("the previous encryption key is the current one; give the key it replaced"));
        }
        Ok(KeyRing { current, previous, cache: Mutex::new((HashMap::new(), 0)) })
    }

    /// Id of the key new chunks are sealed with.
    pub fn key_id(&self) -> [u8; 8] {
        self.current.id
    }

    /// Id of the key that is only read, if any.
    pub fn previous_key_id(&self) -> Option<[u8; 8]> {
        self.previous.as_ref().map(|p| p.id)
    }

    /// `tenant`'s keys, derived once and cached (at most `TENANT_CACHE` tenants).
    pub fn tenant(&self, tenant: &[u8]) -> Arc<TenantKeys> {
        let mut guard = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let (map, clock) = &mut *guard;
        *clock += 1;
        if let Some((keys, used)) = map.get_mut(tenant) {
            *used = *clock;
            return keys.clone();
        }
        if map.len() >= TENANT_CACHE {
            let oldest = map.iter().min_by_key(|(_, (_, used))| *used).map(|(t, _)| t.clone());
            if let Some(t) = oldest {
                map.remove(&t);
            }
        }
        let keys = Arc::new(TenantKeys {
            current: self.current.tenant_key(tenant),
            previous: self.previous.as_ref().map(|p| p.tenant_key(tenant)),
        });
        map.insert(tenant.to_vec(), (keys.clone(), *clock));
        keys
    }

    /// Tenants whose keys are cached.
    pub fn cached_tenants(&self) -> usize {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::format::frame_aad;

    fn key(byte: u8) -> MasterKey {
        MasterKey::from_bytes(&[byte; KEY_FILE_BYTES])
    }

    #[test]
    fn ids_depend_on_the_key_and_the_tenant() {
        let (a, b) = (key(1), key(2));
        assert_ne!(a.id(), b.id());
        assert_eq!(a.id(), key(1).id(), "derived, so stable across opens");
        let (ta, tb) = (a.tenant_key(b"t1"), a.tenant_key(b"t2"));
        assert_ne!(ta.tenant_id, tb.tenant_id);
        assert_ne!(a.tenant_key(b"t1").tenant_id, b.tenant_key(b"t1").tenant_id, "tenant ids are keyed");
        assert_eq!(ta.key_id, a.id());
    }

    #[test]
    fn a_frame_opens_only_with_its_key_nonce_number_and_associated_data() {
        let ring = KeyRing::new(key(7), None).unwrap();
        let k = ring.tenant(b"");
        let header = [3u8; 4096];
        let aad = frame_aad(&header, 2);
        let nonce = fresh_nonce().unwrap();
        let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut sealed = vec![0u8; src.len()];
        let tag = k.current.seal_frame(&nonce, 2, &aad, &src, &mut sealed);
        assert_ne!(sealed, src);
        let mut buf = sealed.clone();
        assert!(k.current.open_frame(&nonce, 2, &aad, &tag, &mut buf));
        assert_eq!(buf, src);
        let other = ring.tenant(b"other");
        assert!(!other.current.open_frame(&nonce, 2, &aad, &tag, &mut sealed.clone()), "another tenant's key");
        assert!(!k.current.open_frame(&nonce, 3, &aad, &tag, &mut sealed.clone()), "another frame number");
        assert!(!k.current.open_frame(&nonce, 2, &frame_aad(&header, 3), &tag, &mut sealed.clone()), "another frame's data");
        let mut flipped = sealed.clone();
        flipped[5000] ^= 0x10;
        assert!(!k.current.open_frame(&nonce, 2, &aad, &tag, &mut flipped));
        let mut bad_tag = tag;
        bad_tag[0] ^= 1;
        assert!(!k.current.open_frame(&nonce, 2, &aad, &bad_tag, &mut sealed.clone()));
    }

    #[test]
    fn the_previous_key_reads_and_the_cache_is_bounded() {
        let ring = KeyRing::new(key(2), Some(key(1))).unwrap();
        let keys = ring.tenant(b"t");
        let old = key(1).tenant_key(b"t");
        let found = keys.for_header(&old.key_id, &old.tenant_id).expect("the previous key's chunk");
        assert_eq!(found.key_id, key(1).id());
        assert!(keys.for_header(&old.key_id, &key(1).tenant_key(b"u").tenant_id).is_none(), "another tenant");
        assert!(KeyRing::new(key(2), Some(key(2))).is_err(), "the same key twice");
        for t in 0..TENANT_CACHE + 10 {
            ring.tenant(&t.to_le_bytes());
        }
        assert_eq!(ring.cached_tenants(), TENANT_CACHE);
    }

    #[test]
    fn frame_nonces_differ_and_wrap() {
        let n = [0xffu8; 12];
        assert_eq!(frame_nonce(&n, 0), n);
        assert_eq!(&frame_nonce(&n, 1)[8..], &[0, 0, 0, 0]);
        assert_eq!(&frame_nonce(&n, 1)[..8], &n[..8]);
        assert_ne!(fresh_nonce().unwrap(), fresh_nonce().unwrap());
    }

    #[test]
    fn key_files_are_checked_and_never_shown() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, [9u8; KEY_FILE_BYTES]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = MasterKey::load(&path, "key file").err().unwrap().to_string();
        assert!(err.contains("chmod 600") && err.contains(&path.display().to_string()) && err.contains("0644"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(MasterKey::load(&path, "key file").unwrap().id(), key(9).id());
        std::fs::write(&path, [9u8; 31]).unwrap();
        let err = MasterKey::load(&path, "key file").err().unwrap().to_string();
        assert!(err.contains("31 bytes") && !err.contains("0909"), "{err}");
        let err = MasterKey::load(dir.path(), "key file").err().unwrap().to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }
}
