//! The write path: `put` on the caller's thread, then sealing (payload CRC
//! and header) and publication on a chunk worker. See the module docs of
//! `store` for the whole life of a put.

use std::time::Duration;

use super::jobs::{DirJob, Job};
use crate::backend::{Backend, SegmentError};
use crate::checksum::crc32c;
use crate::disk::files;
use crate::disk::format::{self, HEADER_BYTES};
use crate::disk::index::ChunkRef;
use crate::error::{EngineError, Result};
use crate::ops::{OpId, Outcome, Status};
use crate::stats::Stats;

use super::completion;
use super::transfer::Transfer;
use super::{BlockStore, Core, OpContext, OpKind, VerifyPolicy};

impl BlockStore {
    pub fn put(&self, key: &[u8], slot: usize, length: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.put_for(b"", key, slot, length, timeout)
    }

    /// `put` sealed for `tenant` (a store without a key ignores it). In a
    /// store that seals, `timeout` also bounds the wait for a seal buffer.
    pub fn put_for(&self, tenant: &[u8], key: &[u8], slot: usize, length: usize, timeout: Option<Duration>) -> Result<OpId> {
        self.check_open()?;
        self.check_args(key, slot)?;
        let pool = &self.core.pool;
        if length > pool.slot_bytes() {
            return Err(EngineError::invalid(format!("length {length} exceeds the slot size {}", pool.slot_bytes())));
        }
        let file_len = format::file_len(length);
        if file_len as u64 > self.core.configured_capacity {
            let cap = self.core.configured_capacity;
            return Err(EngineError::invalid(format!("a {file_len}-byte chunk cannot fit the capacity of {cap} bytes")));
        }
        let (id, mut ctx) = self.begin(OpKind::Put, key, tenant, slot, timeout)?;
        (ctx.file_len, ctx.payload_len) = (file_len, length);
        if let Some(why) = self.core.health.refusal(ctx.root) {
            self.core.refuse(id, ctx, why);
            return Ok(id);
        }
        // Eviction, statvfs, the claim of a victim's file or a fresh one:
        // all can block on an unreachable directory, so none of it runs here.
        self.core.watch(id, &ctx);
        self.core.dirs[ctx.root].push(DirJob::OpenWrite { id, ctx });
        Ok(id)
    }
}

impl Core {
    /// Steps 1 (room, file) and 2 of a put, on a worker of the chunk's directory.
    pub(super) fn open_write(&self, id: OpId, mut ctx: OpContext, backend: &dyn Backend) {
        if self.ops.is_abandoned(id) {
            return self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(libc::ETIMEDOUT), "abandoned before it started"));
        }
        let (hash, root, length, file_len) = (ctx.hash, ctx.root, ctx.payload_len, ctx.file_len);
        // A slot is never a recycled file: its victims' bytes are punched.
        let slots = Some(&self.segments).filter(|s| s.writes);
        let reuse = (self.recycle_files && slots.is_none()).then_some(root);
        if let Err((errno, refused)) = self.reserve_room(&mut ctx, reuse) {
            return self.fail_early(id, ctx, Some(errno), refused);
        }
        if let Some(segs) = slots {
            match segs.take_slot(&self.held, root, file_len as u64) {
                Ok(slot) => {
                    ctx.file_base = slot.file_base();
                    ctx.put_slot = Some(slot);
                }
                Err(e) => {
                    if e.raw_os_error() == Some(libc::ENOENT) && self.check_tree(root, &self.layout.shard_dir(hash)) {
                        return self.skip_gone(id, ctx);
                    }
                    let msg = format!("taking a slot in {}: {e}", segs.roots[root].dir.display());
                    return self.fail_early(id, ctx, e.raw_os_error(), msg);
                }
            }
        } else {
            match self.open_chunk_file(&mut ctx) {
                Ok(f) => ctx.write_file = Some(f),
                Err(e) => {
                    let shard = self.layout.shard_dir(hash);
                    if e.raw_os_error() == Some(libc::ENOENT) && self.check_tree(root, &shard) {
                        return self.skip_gone(id, ctx);
                    }
                    let msg = format!("creating chunk file in {}: {e}", shard.display());
                    return self.fail_early(id, ctx, e.raw_os_error(), msg);
                }
            }
        }
        if self.ops.is_abandoned(id) {
            return self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(libc::ETIMEDOUT), "file opened after the deadline"));
        }
        let fd = ctx.write_fd();
        if ctx.seal.as_ref().is_some_and(|s| s.buffer.is_some()) {
            return self.write_sealed(id, ctx, fd);
        }
        // The payload leaves at once; its checksum (~1.5 ms for 28 MiB: not on
        // the caller's thread) is computed by a chunk worker meanwhile and the
        // header block written last, so the CRC pass overlaps the transfer.
        // The chunk becomes visible only after both writes (publish).
        let (header_ptr, payload_ptr) = (self.header_ptr(id, &ctx), self.payload_ptr(&ctx));
        let file_base = ctx.file_base;
        let pad = file_len - HEADER_BYTES - length;
        if ctx.region.is_none() {
            // `put` refused a length beyond the slot size, so the whole file fits the slot.
            assert!(file_len <= self.pool.stride(), "a {file_len}-byte chunk file in a {}-byte slot", self.pool.stride());
            // SAFETY: `HEADER_BYTES + length + pad == file_len <= stride` (asserted), so the zeroed
            // bytes lie in the slot this operation leased, and no transfer of it is queued yet.
            unsafe { std::ptr::write_bytes(payload_ptr.add(length), 0, pad) };
        }
        // A region's length is whole blocks (`Regions::pin`): no padding, and
        // nothing is ever written to the caller's memory.
        debug_assert!(ctx.region.is_none() || pad == 0);
        // verify="header": no payload checksum, so the header is ready now and
        // the whole file leaves in one go (storage that checksums data itself).
        let sealed_now = self.verify == VerifyPolicy::Header;
        if sealed_now {
            // SAFETY: the header block is HEADER_BYTES long (a slot's first 4 KiB or the
            // operation's own block) and no transfer of this put has started: nothing else touches
            // it.
            let header = unsafe { std::slice::from_raw_parts_mut(header_ptr, HEADER_BYTES) };
            format::encode_header_for(header, &self.namespace, &ctx.key, length as u64, None);
        }
        let from = if sealed_now { 0 } else { HEADER_BYTES };
        let mem = self.file_memory(id, &ctx, fd, true);
        let segments = mem.segment_count(from, file_len, self.write_segment_bytes) as u32 + u32::from(!sealed_now);
        if let Err(ctx) = self.ops.start(id, ctx, segments) {
            return self.fail_early(id, ctx, None, completion::CLOSED_WHILE_SUBMITTING.into());
        }
        mem.submit(backend, from, file_len, self.write_segment_bytes);
        if !sealed_now {
            let header = Transfer::of_memory(id, header_ptr, fd, true, false, root).at(file_base);
            let header = if mem.payload.is_some() { header } else { mem.header };
            self.jobs.push(Job::Seal { id, header, payload: payload_ptr as usize, payload_len: length });
        }
    }
    /// Step 2 of a sealed put: the header fields (a fresh nonce: also for a
    /// recycled or preformatted file) and the padding into its seal buffer,
    /// then the seal jobs, which queue the writes. The caller's memory is
    /// only read, by the seal job.
    fn write_sealed(&self, id: OpId, ctx: OpContext, fd: i32) {
        let (Some(sealing), Some(seal)) = (&self.sealing, ctx.seal.clone()) else {
            return self.fail_early(id, ctx, None, "a sealed put in a store that does not seal".into());
        };
        let buffer = seal.buffer.expect("a sealed put holds a seal buffer");
        let (length, file_len) = (ctx.payload_len, ctx.file_len);
        let nonce = match crate::disk::seal::fresh_nonce() {
            Ok(n) => n,
            Err(e) => return self.fail_early(id, ctx, None, e.to_string()),
        };
        let key = &seal.keys.current;
        let fields =
            format::SealFields { key_id: key.key_id, tenant_id: key.tenant_id, nonce, frame_bytes: format::frame_bytes_for(length as u64) };
        let base = sealing.buffers.ptr(buffer);
        // SAFETY: `put` refused a payload beyond the buffer's room, so the file's `file_len` bytes
        // lie in this put's seal buffer, which no transfer uses yet.
        let image = unsafe { std::slice::from_raw_parts_mut(base, file_len) };
        format::encode_sealed_header(image, &self.namespace, &ctx.key, length as u64, &fields);
        image[HEADER_BYTES + length..].fill(0);
        let dst = sealing.buffers.transfer(id, buffer, fd, ctx.background, ctx.root).at(ctx.file_base);
        let src = self.payload_ptr(&ctx) as usize;
        let plan = super::sealing::SealPlan::new(length, sealing.workers);
        if let Err(ctx) = self.ops.start(id, ctx, plan.segments()) {
            return self.fail_early(id, ctx, None, completion::CLOSED_WHILE_SUBMITTING.into());
        }
        let progress = plan.progress();
        for job in 0..plan.jobs() {
            let (keys, progress) = (seal.keys.clone(), progress.clone());
            self.jobs.push(Job::SealFrames(super::sealing::SealJob { keys, src, payload_len: length, dst, nonce, job, progress }));
        }
    }

    /// Writes the header block in place (a slot's first 4 KiB, or a region
    /// operation's own block), from the payload at `payload`, before the
    /// header's transfer is queued.
    pub(super) fn seal(&self, id: OpId, header: Transfer, payload: *const u8, payload_len: usize) {
        // SAFETY: `payload`/`payload_len` name the payload `write_chunk` queued this seal for,
        // memory the put holds until `finish`; meanwhile only its payload transfers, which read it
        // too, touch it.
        let payload = unsafe { std::slice::from_raw_parts(payload, payload_len) };
        let crc = crc32c(payload);
        // SAFETY: the put's header block is HEADER_BYTES long and nothing else reads or writes it
        // before its transfer is queued, after this seal.
        let header = unsafe { std::slice::from_raw_parts_mut(header.base(), HEADER_BYTES) };
        let sealed = self
            .ops
            .with_context(id.index, |ctx| format::encode_header_for(header, &self.namespace, &ctx.key, payload_len as u64, Some(crc)));
        if sealed.is_none() {
            // Cannot happen (the put is in flight until its header is written);
            // its header write then fails the chunk's checks, nothing is served.
            self.stats.record_error(format!("sealing operation {}: no context", id.index));
        }
    }

    /// Takes the evicted `victim`'s file (of any namespace on this root: a
    /// rename within the root) for `ctx`'s chunk, into `ctx.claimed`; opened
    /// by `open_chunk_file`, outside the capacity ledger's lock.
    pub(super) fn take_victim(&self, ctx: &mut OpContext, (victim, len): (ChunkRef, u64)) {
        if self.segments.place(victim).is_some() {
            // A slot of a segment is no file to take: punched, as any evicted slot.
            self.free_victim(victim, len);
            return;
        }
        let shard = self.layout.shard_dir(ctx.hash);
        let taken = files::take_for_reuse(&self.held, &self.layout.chunk_path_of(victim), &shard, self.ledgers_id());
        let root = self.layout.root_of_ref(victim);
        if taken.as_ref().map_or_else(|(_, removed)| *removed, |_| true) {
            // Its bytes are no longer a published chunk's (`ctx`'s room covers them now).
            self.ledgers.published(root, -(len as i64));
        }
        self.ledgers.evicting(root, -(len as i64));
        match taken {
            Ok(temp) => ctx.claimed = Some(temp),
            // Taken by another process first.
            Err(_) => Stats::add(&self.stats.recycle_skipped, 1),
        }
    }

    /// The file a put writes: the victim's taken by `reserve_room`, else a
    /// fresh one. A fresh file that hits ENOSPC makes room and is tried once more.
    fn open_chunk_file(&self, ctx: &mut OpContext) -> std::io::Result<files::PendingFile> {
        let shard = self.layout.shard_dir(ctx.hash);
        let support = self.support[ctx.root];
        let mut claimed = ctx.claimed.take().and_then(|temp| match files::open_taken(&self.held, temp, ctx.file_len, ctx.direct) {
            Ok(f) => {
                Stats::add(&self.stats.recycled_files, 1);
                Some(f)
            }
            // Read by someone right now, or no flock here: a fresh file.
            Err(_) => {
                Stats::add(&self.stats.recycle_skipped, 1);
                None
            }
        });
        loop {
            let opened = match claimed.take() {
                Some(f) => Ok(f),
                None => files::open_for_write(&self.held, &shard, self.ledgers_id(), support, ctx.direct, self.file_mode),
            };
            // Preallocation also finds a full disk before any byte is written.
            // A recycled file at least as long is allocated already.
            let ready = opened.and_then(|f| {
                if !(self.preallocate && support.fallocate) || f.size >= ctx.file_len as u64 {
                    return Ok(f);
                }
                match files::preallocate(f.fd, ctx.file_len) {
                    Ok(()) => Ok(f),
                    Err(e) => {
                        files::discard(&self.held, &f);
                        Err(e)
                    }
                }
            });
            match ready {
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && !ctx.enospc_retried => {
                    ctx.enospc_retried = true;
                    self.on_enospc(ctx.file_len as u64, ctx.hash);
                }
                other => return other,
            }
        }
    }

    /// A put whose directory turned out gone: skipped and counted, as the
    /// puts after it are while the breaker is open.
    fn skip_gone(&self, id: OpId, ctx: OpContext) {
        Stats::add(&self.health.counters.skipped_puts, 1);
        let why = self.health.refusal(ctx.root).unwrap_or_else(|| "storage directory gone".into());
        self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(libc::EAGAIN), format!("{why}: put skipped")));
    }

    pub(super) fn finish_put(&self, id: OpId, mut ctx: OpContext, error: Option<SegmentError>, backend: &dyn Backend) {
        if let Some(err) = error {
            let errno = match err {
                SegmentError::Errno(e) => e,
                SegmentError::Eof => libc::EIO,
                SegmentError::BackendFailed(e) => {
                    return self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(e), completion::backend_failed("writing", e)));
                }
            };
            if errno == libc::ENOSPC && !ctx.enospc_retried {
                // Once: evict, then write the whole (still sealed) slot again.
                ctx.enospc_retried = true;
                self.on_enospc(ctx.file_len as u64, ctx.hash);
                let fd = ctx.write_fd();
                return completion::submit(self, backend, id, ctx, fd, true);
            }
            if errno == libc::ENOSPC {
                Stats::add(&self.stats.write_enospc, 1);
            }
            let msg = format!("writing chunk: {}", std::io::Error::from_raw_os_error(errno));
            return self.finish(id, ctx, Outcome::new(Status::Error, 0, Some(errno), msg));
        }
        if ctx.put_slot.is_some() {
            return self.publish_slot(id, ctx);
        }
        let file = ctx.write_file.take().expect("put without a file");
        if !ctx.direct {
            files::drop_cached_pages(file.fd, true);
        }
        let path = self.layout.chunk_path(ctx.hash);
        let published = files::publish(&self.held, &file, &path, self.support[ctx.root].rename_noreplace);
        if file.temp_path.is_some() {
            // Drop the temp file's lock now, synchronously: on a network or
            // FUSE filesystem the release at close() is sent asynchronously,
            // and a reader on another node that opens the just-published
            // chunk meanwhile would find it locked and call it a miss.
            // SAFETY: flock takes no pointer; `file.fd` is open until the close below.
            unsafe { libc::flock(file.fd, libc::LOCK_UN) };
        }
        files::close(file.fd);
        match published {
            Ok(first) => {
                if !first {
                    Stats::add(&self.stats.write_races, 1);
                }
                {
                    let mut index = self.index.lock().unwrap();
                    index.insert(ctx.hash, ctx.file_len as u64);
                    if first {
                        // Published before the room is released: the ledger's
                        // total never dips below what is on disk.
                        self.ledgers.published(ctx.root, ctx.file_len as i64);
                    }
                    self.release_reservation_locked(&mut index, &mut ctx);
                }
                // Concurrent puts each made room for themselves only; trim the overshoot.
                self.make_room(0, ctx.hash, None, None);
                let len = ctx.payload_len as u64;
                self.finish(id, ctx, Outcome::new(Status::Ok, len, None, ""))
            }
            Err(e) => {
                if let Some(temp) = &file.temp_path {
                    let _ = self.held.unlink(temp);
                }
                if e.raw_os_error() == Some(libc::ENOENT) && self.check_tree(ctx.root, &self.layout.shard_dir(ctx.hash)) {
                    return self.skip_gone(id, ctx);
                }
                let msg = format!("publishing {}: {e}", path.display());
                self.finish(id, ctx, Outcome::new(Status::Error, 0, e.raw_os_error(), msg))
            }
        }
    }
}
