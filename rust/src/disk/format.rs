//! On-disk chunk format: a 4 KiB header followed by the payload, padded to
//! 4 KiB so that every byte of the file is transferred with O_DIRECT.
//!
//! The header is self-verifying (its own CRC) and binds the payload to the
//! namespace and the full key, so a foreign, renamed, truncated or bit-flipped
//! file can never be returned as data.
//!
//! A sealed chunk (`FLAG_SEALED`, decision 0083) carries, after the key area,
//! the key id, the tenant id, a random nonce, its frame size and one
//! AES-256-GCM tag per frame of the payload; the tags replace the payload CRC.
//! Each frame's associated data is the header up to the tags (its CRC field
//! zeroed) followed by the frame's number (`frame_aad`), so a sealed payload
//! moved under another name, namespace, tenant, key or length fails to open.

use xxhash_rust::xxh3::xxh3_128;

use crate::checksum::crc32c;

pub const HEADER_BYTES: usize = 4096;
pub const IO_ALIGN: usize = 4096;
pub const FORMAT_VERSION: u32 = 1;
pub const MAGIC: [u8; 8] = *b"PYKVCHNK";
pub const MAX_KEY_BYTES: usize = 1024;

// Field offsets inside the header block.
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_HEADER_LEN: usize = 12;
const OFF_NAMESPACE: usize = 16;
const OFF_PAYLOAD_LEN: usize = 32;
const OFF_PAYLOAD_CRC: usize = 40;
const OFF_KEY_LEN: usize = 44;
const OFF_HEADER_CRC: usize = 48;
const OFF_FLAGS: usize = 52;
const OFF_KEY: usize = 64;
// Sealed chunks only: after the key area.
const OFF_KEY_ID: usize = OFF_KEY + MAX_KEY_BYTES;
const OFF_TENANT_ID: usize = OFF_KEY_ID + 8;
const OFF_NONCE: usize = OFF_TENANT_ID + 16;
const OFF_FRAME_BYTES: usize = OFF_NONCE + 12;
const OFF_TAGS: usize = OFF_FRAME_BYTES + 4;
pub const TAG_BYTES: usize = 16;
/// Tags that fit the header: at most this many frames per chunk.
pub const MAX_FRAMES: usize = (HEADER_BYTES - OFF_TAGS) / TAG_BYTES;
/// The smallest frame: a read opens each frame as soon as its bytes landed,
/// a write starts writing after its first frame is sealed.
pub const MIN_FRAME_BYTES: usize = 1 << 20;
/// Associated data of one frame: the header up to the tags, then the frame number.
pub const AAD_BYTES: usize = OFF_TAGS + 4;
/// The header bytes before the tags: what `frame_aad` reads.
pub const SEALED_FIELDS_END: usize = OFF_TAGS;

/// Where frame `frame`'s tag lies in a sealed header.
pub fn tag_offset(frame: usize) -> usize {
    assert!(frame < MAX_FRAMES, "frame {frame} of at most {MAX_FRAMES}");
    OFF_TAGS + frame * TAG_BYTES
}

/// Header flag: the writer computed no payload checksum (`verify="header"`,
/// for storage that checksums data itself); the payload CRC field is 0.
/// Files written before flags existed have 0 here: checksummed.
pub const FLAG_PAYLOAD_UNCHECKED: u32 = 1;
/// Header flag: the payload is AES-256-GCM ciphertext in frames, the sealed
/// fields are set and the payload CRC field is 0 (decision 0083).
pub const FLAG_SEALED: u32 = 2;
const KNOWN_FLAGS: u32 = FLAG_PAYLOAD_UNCHECKED | FLAG_SEALED;

pub type Fingerprint = [u8; 16];

/// 128-bit fingerprint of a namespace description (model, dtype, layout, ...).
pub fn namespace_fingerprint(namespace: &str) -> Fingerprint {
    xxh3_128(namespace.as_bytes()).to_le_bytes()
}

/// Content-addressed file identity of a key: names derive only from this hash,
/// so no key can escape the store root.
pub fn key_hash(key: &[u8]) -> u128 {
    xxh3_128(key)
}

pub fn round_up(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

/// Total file length for a payload of `payload_len` bytes.
pub fn file_len(payload_len: usize) -> usize {
    HEADER_BYTES + round_up(payload_len, IO_ALIGN)
}

/// The frame size of a sealed payload of `payload_len` bytes: a function of
/// its padded length, so that a reader knows the frames from the file's size
/// before the header lands. A multiple of `IO_ALIGN`, at least
/// `MIN_FRAME_BYTES`, large enough for the tags to fit the header.
pub fn frame_bytes_for(payload_len: u64) -> u64 {
    let padded = round_up_u64(payload_len).unwrap_or(u64::MAX);
    let spread = padded.div_ceil(MAX_FRAMES as u64);
    round_up_u64(spread).unwrap_or(u64::MAX).max(MIN_FRAME_BYTES as u64)
}

/// Frames of a sealed payload of `payload_len` bytes (an empty payload has one, empty).
pub fn frame_count(payload_len: u64) -> usize {
    payload_len.div_ceil(frame_bytes_for(payload_len)).max(1) as usize
}

/// The sealed fields of a header (`FLAG_SEALED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SealFields {
    /// Names the key file (derived from it, never the key).
    pub key_id: [u8; 8],
    /// Names the tenant under that key (derived from key and tenant).
    pub tenant_id: [u8; 16],
    /// Random per write; frame `i` uses it with `i` folded in (`disk::seal`).
    pub nonce: [u8; 12],
    pub frame_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHeader {
    pub namespace: Fingerprint,
    pub payload_len: u64,
    /// None: written without a payload checksum (FLAG_PAYLOAD_UNCHECKED), or sealed.
    pub payload_crc: Option<u32>,
    /// Some: the payload is sealed; its tags are in the header (`tag`).
    pub sealed: Option<SealFields>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("header shorter than {HEADER_BYTES} bytes")]
    Short,
    #[error("bad magic (not a pykvcache chunk)")]
    BadMagic,
    #[error("unsupported format version {0} (this build reads {FORMAT_VERSION})")]
    Version(u32),
    #[error("header checksum mismatch")]
    HeaderCrc,
    #[error("header length {0} is not {HEADER_BYTES}")]
    HeaderLen(u32),
    #[error("chunk belongs to another namespace")]
    Namespace,
    #[error("chunk holds another key")]
    Key,
    #[error("key length {0} out of range")]
    KeyLen(u32),
    #[error("payload length {declared} does not fit a file of {file_len} bytes")]
    Length { declared: u64, file_len: u64 },
    #[error("payload checksum mismatch")]
    PayloadCrc,
    #[error("unknown header flags {0:#x} (written by a newer pykvcache?)")]
    Flags(u32),
    #[error("sealed chunk declares frames of {declared} bytes, its length implies {expected}")]
    Frames { declared: u64, expected: u64 },
}

#[cfg(test)] // the engine seals in place (`encode_header_for`) and verifies piecewise
/// Writes a header for `payload` into `block` (at least HEADER_BYTES long).
pub fn encode_header(block: &mut [u8], namespace: &Fingerprint, key: &[u8], payload: &[u8]) {
    encode_header_for(block, namespace, key, payload.len() as u64, Some(crc32c(payload)));
}

/// `encode_header` from the payload's length and CRC-32C (None: no payload
/// checksum, flagged), for a writer that checksums the payload while it is
/// already being written, or not at all.
pub fn encode_header_for(block: &mut [u8], namespace: &Fingerprint, key: &[u8], payload_len: u64, payload_crc: Option<u32>) {
    assert!(block.len() >= HEADER_BYTES && key.len() <= MAX_KEY_BYTES);
    let block = &mut block[..HEADER_BYTES];
    block.fill(0);
    block[OFF_MAGIC..OFF_MAGIC + 8].copy_from_slice(&MAGIC);
    put_u32(block, OFF_VERSION, FORMAT_VERSION);
    put_u32(block, OFF_HEADER_LEN, HEADER_BYTES as u32);
    block[OFF_NAMESPACE..OFF_NAMESPACE + 16].copy_from_slice(namespace);
    put_u64(block, OFF_PAYLOAD_LEN, payload_len);
    put_u32(block, OFF_PAYLOAD_CRC, payload_crc.unwrap_or(0));
    put_u32(block, OFF_FLAGS, if payload_crc.is_some() { 0 } else { FLAG_PAYLOAD_UNCHECKED });
    put_u32(block, OFF_KEY_LEN, key.len() as u32);
    block[OFF_KEY..OFF_KEY + key.len()].copy_from_slice(key);
    let crc = crc32c(block);
    put_u32(block, OFF_HEADER_CRC, crc);
}

/// Writes the header of a sealed payload into `block`: every field but the
/// tags (zero; `set_tag`) and the header CRC (`seal_header_crc`, once the
/// tags are in).
pub fn encode_sealed_header(block: &mut [u8], namespace: &Fingerprint, key: &[u8], payload_len: u64, fields: &SealFields) {
    encode_header_for(block, namespace, key, payload_len, Some(0));
    let block = &mut block[..HEADER_BYTES];
    put_u32(block, OFF_FLAGS, FLAG_SEALED);
    block[OFF_KEY_ID..OFF_KEY_ID + 8].copy_from_slice(&fields.key_id);
    block[OFF_TENANT_ID..OFF_TENANT_ID + 16].copy_from_slice(&fields.tenant_id);
    block[OFF_NONCE..OFF_NONCE + 12].copy_from_slice(&fields.nonce);
    put_u32(block, OFF_FRAME_BYTES, u32::try_from(fields.frame_bytes).unwrap_or(u32::MAX));
    put_u32(block, OFF_HEADER_CRC, 0);
}

/// The tag of frame `frame` into a sealed header (before `seal_header_crc`).
#[cfg(test)] // the seal jobs write their tags through `tag_offset`, each its own
pub fn set_tag(block: &mut [u8], frame: usize, tag: &[u8; TAG_BYTES]) {
    let at = tag_offset(frame);
    block[at..at + TAG_BYTES].copy_from_slice(tag);
}

/// The tag of frame `frame` of a sealed header.
pub fn tag(block: &[u8], frame: usize) -> [u8; TAG_BYTES] {
    let at = tag_offset(frame);
    block[at..at + TAG_BYTES].try_into().unwrap()
}

/// Computes and stores the header CRC over the whole block (its own field as 0).
pub fn seal_header_crc(block: &mut [u8]) {
    let block = &mut block[..HEADER_BYTES];
    put_u32(block, OFF_HEADER_CRC, 0);
    let crc = crc32c(block);
    put_u32(block, OFF_HEADER_CRC, crc);
}

/// The associated data of frame `frame`: the header up to the tags with its
/// CRC field zeroed (identity, lengths, flags, key id, tenant id, nonce,
/// frame size), then the frame number.
pub fn frame_aad(block: &[u8], frame: u32) -> [u8; AAD_BYTES] {
    let block = &block[..OFF_TAGS];
    let mut aad = [0u8; AAD_BYTES];
    aad[..OFF_TAGS].copy_from_slice(&block[..OFF_TAGS]);
    put_u32(&mut aad, OFF_HEADER_CRC, 0);
    put_u32(&mut aad, OFF_TAGS, frame);
    aad
}

/// Parses and checks a header against the expected namespace and key.
/// `file_len` is the size of the file it came from.
pub fn decode_header(block: &[u8], namespace: &Fingerprint, key: &[u8], file_len: u64) -> Result<ChunkHeader, FormatError> {
    if block.len() < HEADER_BYTES {
        return Err(FormatError::Short);
    }
    let block = &block[..HEADER_BYTES];
    if block[OFF_MAGIC..OFF_MAGIC + 8] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    let version = get_u32(block, OFF_VERSION);
    if version != FORMAT_VERSION {
        return Err(FormatError::Version(version));
    }
    let stored_crc = get_u32(block, OFF_HEADER_CRC);
    let mut sealed = [0u8; HEADER_BYTES];
    sealed.copy_from_slice(block);
    put_u32(&mut sealed, OFF_HEADER_CRC, 0);
    if crc32c(&sealed) != stored_crc {
        return Err(FormatError::HeaderCrc);
    }
    let header_len = get_u32(block, OFF_HEADER_LEN);
    if header_len as usize != HEADER_BYTES {
        return Err(FormatError::HeaderLen(header_len));
    }
    if block[OFF_NAMESPACE..OFF_NAMESPACE + 16] != namespace[..] {
        return Err(FormatError::Namespace);
    }
    let key_len = get_u32(block, OFF_KEY_LEN);
    if key_len as usize > MAX_KEY_BYTES {
        return Err(FormatError::KeyLen(key_len));
    }
    if &block[OFF_KEY..OFF_KEY + key_len as usize] != key {
        return Err(FormatError::Key);
    }
    let payload_len = get_u64(block, OFF_PAYLOAD_LEN);
    // Checked all the way: a declared length near u64::MAX must not wrap to a
    // small file size (it would then be trusted as the payload slice length).
    let expected = round_up_u64(payload_len).and_then(|p| (HEADER_BYTES as u64).checked_add(p));
    if expected != Some(file_len) {
        return Err(FormatError::Length { declared: payload_len, file_len });
    }
    let flags = get_u32(block, OFF_FLAGS);
    if flags & !KNOWN_FLAGS != 0 {
        return Err(FormatError::Flags(flags));
    }
    let unchecked = flags & FLAG_PAYLOAD_UNCHECKED != 0;
    if flags & FLAG_SEALED == 0 {
        let payload_crc = (!unchecked).then(|| get_u32(block, OFF_PAYLOAD_CRC));
        return Ok(ChunkHeader { namespace: *namespace, payload_len, payload_crc, sealed: None });
    }
    if unchecked {
        // Sealed payloads are always authenticated: no writer sets both.
        return Err(FormatError::Flags(flags));
    }
    let fields = SealFields {
        key_id: block[OFF_KEY_ID..OFF_KEY_ID + 8].try_into().unwrap(),
        tenant_id: block[OFF_TENANT_ID..OFF_TENANT_ID + 16].try_into().unwrap(),
        nonce: block[OFF_NONCE..OFF_NONCE + 12].try_into().unwrap(),
        frame_bytes: u64::from(get_u32(block, OFF_FRAME_BYTES)),
    };
    let expected = frame_bytes_for(payload_len);
    if fields.frame_bytes != expected {
        return Err(FormatError::Frames { declared: fields.frame_bytes, expected });
    }
    Ok(ChunkHeader { namespace: *namespace, payload_len, payload_crc: None, sealed: Some(fields) })
}

#[cfg(test)] // the engine seals in place (`encode_header_for`) and verifies piecewise
pub fn verify_payload(header: &ChunkHeader, payload: &[u8]) -> Result<(), FormatError> {
    if payload.len() as u64 != header.payload_len || Some(crc32c(payload)) != header.payload_crc {
        return Err(FormatError::PayloadCrc);
    }
    Ok(())
}

fn round_up_u64(n: u64) -> Option<u64> {
    n.checked_next_multiple_of(IO_ALIGN as u64)
}

fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}
fn get_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encoded(ns: &Fingerprint, key: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut block = vec![0u8; HEADER_BYTES];
        encode_header(&mut block, ns, key, payload);
        block
    }

    #[test]
    fn round_trip() {
        let ns = namespace_fingerprint("model-a");
        let payload = vec![7u8; 10_000];
        let block = encoded(&ns, b"key-1", &payload);
        let h = decode_header(&block, &ns, b"key-1", file_len(payload.len()) as u64).unwrap();
        assert_eq!(h.payload_len, 10_000);
        verify_payload(&h, &payload).unwrap();
    }

    #[test]
    fn rejects_other_namespace_key_length_and_payload() {
        let ns = namespace_fingerprint("model-a");
        let payload = vec![1u8; 8192];
        let block = encoded(&ns, b"k", &payload);
        let len = file_len(payload.len()) as u64;
        let other = namespace_fingerprint("model-b");
        assert_eq!(decode_header(&block, &other, b"k", len), Err(FormatError::Namespace));
        assert_eq!(decode_header(&block, &ns, b"j", len), Err(FormatError::Key));
        assert!(matches!(decode_header(&block, &ns, b"k", len - 4096), Err(FormatError::Length { .. })));
        let h = decode_header(&block, &ns, b"k", len).unwrap();
        let mut bad = payload.clone();
        bad[100] ^= 1;
        assert_eq!(verify_payload(&h, &bad), Err(FormatError::PayloadCrc));
        assert_eq!(decode_header(&block[..100], &ns, b"k", len), Err(FormatError::Short));
    }

    #[test]
    fn unchecked_payloads_are_flagged_and_unknown_flags_refused() {
        let ns = namespace_fingerprint("ns");
        let mut block = vec![0u8; HEADER_BYTES];
        encode_header_for(&mut block, &ns, b"k", 5000, None);
        let h = decode_header(&block, &ns, b"k", file_len(5000) as u64).unwrap();
        assert_eq!((h.payload_len, h.payload_crc), (5000, None));
        assert_eq!(verify_payload(&h, &[0u8; 5000]), Err(FormatError::PayloadCrc), "nothing to verify against");
        assert_eq!(get_u32(&block, OFF_FLAGS), FLAG_PAYLOAD_UNCHECKED);
        put_u32(&mut block, OFF_FLAGS, 0x4);
        put_u32(&mut block, OFF_HEADER_CRC, 0);
        let crc = crc32c(&block);
        put_u32(&mut block, OFF_HEADER_CRC, crc);
        assert_eq!(decode_header(&block, &ns, b"k", file_len(5000) as u64), Err(FormatError::Flags(0x4)));
    }

    #[test]
    fn declared_length_that_wraps_when_rounded_is_rejected() {
        // A resealed header claiming ~2^64 payload bytes in a header-only file.
        let ns = namespace_fingerprint("ns");
        for declared in [u64::MAX, u64::MAX - 4094] {
            let mut block = encoded(&ns, b"k", b"");
            put_u64(&mut block, OFF_PAYLOAD_LEN, declared);
            put_u32(&mut block, OFF_HEADER_CRC, 0);
            let crc = crc32c(&block);
            put_u32(&mut block, OFF_HEADER_CRC, crc);
            let got = decode_header(&block, &ns, b"k", HEADER_BYTES as u64);
            assert!(matches!(got, Err(FormatError::Length { .. })), "{got:?}");
        }
    }

    fn sealed_block(payload_len: u64) -> Vec<u8> {
        let ns = namespace_fingerprint("ns");
        let fields = SealFields { key_id: [1; 8], tenant_id: [2; 16], nonce: [3; 12], frame_bytes: frame_bytes_for(payload_len) };
        let mut block = vec![0u8; HEADER_BYTES];
        encode_sealed_header(&mut block, &ns, b"k", payload_len, &fields);
        set_tag(&mut block, 0, &[9; TAG_BYTES]);
        seal_header_crc(&mut block);
        block
    }

    #[test]
    fn sealed_headers_round_trip_and_their_frame_size_is_checked() {
        let ns = namespace_fingerprint("ns");
        let len = (3 << 20) + 5;
        let block = sealed_block(len);
        let h = decode_header(&block, &ns, b"k", file_len(len as usize) as u64).unwrap();
        let f = h.sealed.unwrap();
        assert_eq!((h.payload_crc, f.key_id, f.tenant_id, f.nonce), (None, [1; 8], [2; 16], [3; 12]));
        assert_eq!((f.frame_bytes, frame_count(len)), (MIN_FRAME_BYTES as u64, 4));
        assert_eq!(tag(&block, 0), [9; TAG_BYTES]);
        let mut bad = block.clone();
        put_u32(&mut bad, OFF_FRAME_BYTES, 4096);
        seal_header_crc(&mut bad);
        assert!(matches!(decode_header(&bad, &ns, b"k", file_len(len as usize) as u64), Err(FormatError::Frames { .. })));
        let mut both = block.clone();
        put_u32(&mut both, OFF_FLAGS, FLAG_SEALED | FLAG_PAYLOAD_UNCHECKED);
        seal_header_crc(&mut both);
        assert!(matches!(decode_header(&both, &ns, b"k", file_len(len as usize) as u64), Err(FormatError::Flags(_))));
    }

    #[test]
    fn the_associated_data_binds_the_identity_and_the_frame_but_not_the_tags_or_crc() {
        let block = sealed_block(5000);
        let aad = frame_aad(&block, 0);
        assert_ne!(aad, frame_aad(&block, 1));
        let mut tagged = block.clone();
        set_tag(&mut tagged, 3, &[7; TAG_BYTES]);
        seal_header_crc(&mut tagged);
        assert_eq!(frame_aad(&tagged, 0), aad, "tags and CRC are not associated data");
        for at in
            [OFF_MAGIC, OFF_NAMESPACE, OFF_PAYLOAD_LEN, OFF_FLAGS, OFF_KEY, OFF_KEY_ID, OFF_TENANT_ID, OFF_NONCE + 11, OFF_FRAME_BYTES]
        {
            let mut other = block.clone();
            other[at] ^= 1;
            assert_ne!(frame_aad(&other, 0), aad, "byte {at} is bound");
        }
    }

    #[test]
    fn frames_always_fit_the_header() {
        for len in [0u64, 1, 4096, (1 << 20) - 1, 1 << 20, 185 << 20, (185 << 20) + 1, 1 << 40, (1 << 44) - 1] {
            let f = frame_bytes_for(len);
            assert!(f.is_multiple_of(IO_ALIGN as u64) && f >= MIN_FRAME_BYTES as u64, "{len}: {f}");
            assert!(frame_count(len) <= MAX_FRAMES, "{len}: {} frames", frame_count(len));
            let padded = round_up_u64(len).unwrap();
            assert_eq!(frame_bytes_for(padded), f, "a function of the padded length");
        }
        assert_eq!(MAX_FRAMES, 185);
    }

    proptest! {
        #[test]
        fn any_single_bit_flip_in_header_is_detected(bit in 0usize..HEADER_BYTES * 8) {
            let ns = namespace_fingerprint("ns");
            let payload = vec![3u8; 4096];
            let mut block = encoded(&ns, b"some-key", &payload);
            block[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(decode_header(&block, &ns, b"some-key", file_len(4096) as u64).is_err());
        }

        #[test]
        fn decoder_never_panics_on_garbage(data in proptest::collection::vec(any::<u8>(), 0..HEADER_BYTES + 64),
                                           file_len in any::<u64>()) {
            let ns = namespace_fingerprint("ns");
            let _ = decode_header(&data, &ns, b"k", file_len);
        }

        #[test]
        fn round_trip_any(key in proptest::collection::vec(any::<u8>(), 0..MAX_KEY_BYTES),
                          payload in proptest::collection::vec(any::<u8>(), 0..20_000)) {
            let ns = namespace_fingerprint("ns");
            let block = encoded(&ns, &key, &payload);
            let h = decode_header(&block, &ns, &key, file_len(payload.len()) as u64).unwrap();
            prop_assert!(verify_payload(&h, &payload).is_ok());
        }
    }
}
