//! On-disk chunk format: a 4 KiB header followed by the payload, padded to
//! 4 KiB so that every byte of the file is transferred with O_DIRECT.
//!
//! The header is self-verifying (its own CRC) and binds the payload to the
//! namespace and the full key, so a foreign, renamed, truncated or bit-flipped
//! file can never be returned as data.

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

/// Header flag: the writer computed no payload checksum (`verify="header"`,
/// for storage that checksums data itself); the payload CRC field is 0.
/// Files written before flags existed have 0 here: checksummed.
pub const FLAG_PAYLOAD_UNCHECKED: u32 = 1;
const KNOWN_FLAGS: u32 = FLAG_PAYLOAD_UNCHECKED;

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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHeader {
    pub namespace: Fingerprint,
    pub payload_len: u64,
    /// None: written without a payload checksum (FLAG_PAYLOAD_UNCHECKED).
    pub payload_crc: Option<u32>,
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
    Ok(ChunkHeader { namespace: *namespace, payload_len, payload_crc: (!unchecked).then(|| get_u32(block, OFF_PAYLOAD_CRC)) })
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
