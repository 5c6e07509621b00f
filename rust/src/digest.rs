//! Content digest of a byte range of an open file: xxh3-128 over every byte.
//!
//! The vLLM integration identifies a model's weights by a digest of all their
//! bytes (decision 0052). A 16 GB checkpoint has to be hashed at disk speed at
//! start-up, which Python's `hashlib` cannot do (sha256 1.1–1.5 GB/s a core here);
//! xxh3 runs at memory speed. Callers split a file into fixed pieces and
//! digest them on several threads (each call needs no GIL), so the result does
//! not depend on how many threads ran.

use std::io;
use std::os::fd::RawFd;

use xxhash_rust::xxh3::Xxh3;

/// Bytes read per `pread`: large enough that the syscall's cost vanishes next
/// to hashing, small enough that a buffer per thread costs little memory.
const READ_BYTES: usize = 4 << 20;

/// xxh3-128 of the `length` bytes of `fd` from `offset` (read with `pread`, so
/// threads can share one descriptor). A file shorter than the range is an
/// error (`UnexpectedEof`): the caller's size came from `fstat` and the file
/// shrank underneath it.
pub fn xxh3_128_range(fd: RawFd, offset: u64, length: u64) -> io::Result<u128> {
    let mut hasher = Xxh3::new();
    let mut buf = vec![0u8; READ_BYTES.min(length as usize).max(1)];
    let mut done: u64 = 0;
    while done < length {
        let want = buf.len().min((length - done) as usize);
        let pos = offset.checked_add(done).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let pos = libc::off_t::try_from(pos).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `buf` is valid for `want` bytes; the kernel writes at most that.
        let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), want, pos) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("file ended {done} bytes into a {length}-byte range at {offset}"),
            ));
        }
        hasher.update(&buf[..n as usize]);
        done += n as u64;
    }
    Ok(hasher.digest128())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use xxhash_rust::xxh3::xxh3_128;

    fn file_of(data: &[u8]) -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(data).unwrap();
        f
    }

    #[test]
    fn a_range_digest_is_the_xxh3_of_its_bytes_across_read_boundaries() {
        let data: Vec<u8> = (0..READ_BYTES * 2 + 12_345).map(|i| (i * 31 % 251) as u8).collect();
        let f = file_of(&data);
        let fd = f.as_raw_fd();
        assert_eq!(xxh3_128_range(fd, 0, data.len() as u64).unwrap(), xxh3_128(&data));
        let (a, b) = (READ_BYTES - 7, READ_BYTES * 2 + 5);
        assert_eq!(xxh3_128_range(fd, a as u64, (b - a) as u64).unwrap(), xxh3_128(&data[a..b]));
        assert_eq!(xxh3_128_range(fd, 3, 0).unwrap(), xxh3_128(b""));
    }

    #[test]
    fn a_range_past_the_end_of_the_file_is_an_error() {
        let f = file_of(&[1u8; 1000]);
        let err = xxh3_128_range(f.as_raw_fd(), 500, 501).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
