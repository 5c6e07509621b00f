"""Type stubs for the Rust extension module ``pykvcache._core``.

Hand-written (as pydantic-core does) so that the public surface is reviewed,
not generated. Every blocking call releases the GIL.

Every ``timeout`` / ``submit_timeout`` is in seconds: ``None`` waits forever,
and so does any value above ``FOREVER_S`` = 1e9 s (about 31.7 years;
``math.inf`` included). ``io_deadline`` too, except that its ``None`` is the
engine's default deadline.
NaN or a negative value raises ``ValueError`` naming the argument. Every size
and count (``slot_bytes``, ``num_slots``, ``capacity_bytes``, ``queue_depth``,
``segment_bytes``, ``write_segment_bytes``, ``max_inflight``, ``io_threads``,
``chunk_workers``, a put's ``length``) out of range, negative or past 2**64
included, raises ``ValueError`` naming it (and its bounds where they are fixed).
"""

from collections.abc import Sequence
from os import PathLike
from typing import Literal, TypedDict, final

from typing_extensions import Buffer

__version__: str

#: Bytes reserved in front of every staging slot and every chunk file for the
#: chunk header. Payloads start at this offset, so they stay O_DIRECT-aligned.
HEADER_BYTES: int
#: Current on-disk format version.
FORMAT_VERSION: int
#: Alignment of every transfer, chunk file length and staging slot (O_DIRECT).
IO_ALIGN: int
#: Accepted ``BlockStore(backend=...)`` values.
BACKENDS: tuple[str, ...]
#: Accepted ``BlockStore(direct_io=...)`` values.
DIRECT_IO_POLICIES: tuple[str, ...]
#: Accepted ``BlockStore(verify=...)`` values.
VERIFY_MODES: tuple[str, ...]
#: The engine's defaults of the ``BlockStore`` keywords (``queue_depth``,
#: ``max_inflight``, ``segment_bytes``, ``write_segment_bytes``, ``io_threads``,
#: ``chunk_workers``, ``seal_buffers``, ``submit_timeout``, ``backend``, ``direct_io``, ``verify``,
#: ``dir_mode``, ``file_mode``): the one place they are defined
#: (``rust/src/store/config.rs``); the defaults below repeat them, checked by
#: ``tests/test_core_constants.py``.
ENGINE_DEFAULTS: dict[str, int | float | str]
#: The engine's inclusive bounds ``(low, high)`` of the counts ``queue_depth``,
#: ``max_inflight``, ``io_threads``, ``chunk_workers``, ``seal_buffers`` (``BlockStore``) and
#: ``num_slots`` (``StagingPool``): the one place they are defined
#: (``rust/src/store/config.rs``, ``limits``); the vLLM layer reads them.
ENGINE_LIMITS: dict[str, tuple[int, int]]
#: Timeouts above this many seconds (about 31.7 years) mean "forever".
FOREVER_S: float
#: Whether this build has the engine's test hooks (cargo feature ``fault-injection``):
#: ``BlockStore``'s ``_fault_*`` keywords. True in the build ``make develop`` makes for the
#: tests; False in the release wheel (``make wheel``), whose ``BlockStore`` refuses them
#: (``TypeError``).
FAULT_INJECTION: bool

def key_hash(key: bytes) -> int:
    """The 128-bit hash a chunk's file is named by (``BlockStore.take_removed``)."""

def digest_range(fd: int, offset: int, length: int) -> int:
    """xxh3-128 of the ``length`` bytes of the open file ``fd`` from ``offset``
    (``pread``, without the GIL: threads may digest pieces of one file at once).
    ``OSError`` when the file ends before the range does. The vLLM
    integration's weights identity (``pykvcache.vllm.identity.weights_digest``)."""

def chunk_file_bytes(payload_bytes: int) -> int:
    """Bytes of the chunk file that holds ``payload_bytes`` (``HEADER_BYTES``
    plus the payload rounded up to ``IO_ALIGN``): its cost on disk and the
    staging slot footprint. ``OverflowError`` past what a file can hold."""

def probe_storage_dir(path: str | PathLike[str], *, file_mode: int = 0o600) -> dict[str, bool]:
    """What the existing directory's filesystem supports, found by trying it (the
    probe every store runs on its directories at open): ``o_direct`` (an aligned
    direct write and read), ``o_tmpfile``, ``fallocate``,
    ``unaligned_o_direct_accepted`` (NFS, FUSE: O_DIRECT enforces no alignment;
    harmless), ``o_direct_settable_after_open`` (recorded only: chunk files
    are opened with O_DIRECT from the start, as GPFS ignores it set later) and
    ``rename_noreplace`` (``renameat2(RENAME_NOREPLACE)`` works: GlusterFS's
    client refuses it, and a store there publishes with a plain rename at once)
    and ``punch_hole`` (a punched hole reads back as zeros: ``segment_files="auto"``
    writes segment files only there)."""

def check_storage_dir(path: str | PathLike[str], *, allow_insecure_root: bool = False) -> None:
    """Raises the ``ValueError`` opening a store on the existing directory
    ``path`` would raise about it (not a directory, owned by another user,
    world-writable unless ``allow_insecure_root``); creates nothing."""

def check_key_file(path: str | PathLike[str], *, what: str = "encryption_key_file") -> str:
    """Reads the key file ``path`` as ``BlockStore(encryption_key_file=...)``
    would and raises what it would raise (``ValueError``: not a regular file,
    group or others may read or write it, not 32 bytes; ``OSError``: cannot
    open or read it), ``what`` naming the setting in the message. Returns the
    key's id (hex, as ``stats()["encryption_key_id"]``), never key bytes."""

class StoreStats(TypedDict):
    """What ``BlockStore.stats()`` returns (every key, always present)."""

    bytes_read: int
    bytes_written: int
    reads: int
    prefetches: int
    #: Prefetches raised to demand priority before all their transfers started
    #: (:meth:`IoHandle.promote`).
    promotions: int
    writes: int
    read_hits: int
    read_misses: int
    corrupt_chunks: int
    read_errors: int
    write_errors: int
    write_enospc: int
    write_races: int
    evictions: int
    evicted_bytes: int
    recycled_files: int
    recycle_skipped: int
    enospc_retries: int
    enospc_evictions: int
    capacity_lowered: int
    reserve_evictions: int
    reserve_refused: int
    #: Puts skipped because the capacity ledger showed the room held by other
    #: writers' chunks this store had not walked yet (a walk follows at once).
    shared_capacity_refused: int
    #: Anomalies the engine survived instead of panicking (each also on stderr).
    internal_errors: int
    # Sealed chunks (``encryption_key_file``, decision 0083): puts sealed, gets
    # whose every frame opened, gets of a chunk sealed with another key or for
    # another tenant, a plaintext chunk where chunks are sealed or a sealed one
    # where they are not (misses of kind "kept", never deleted), and gets whose
    # frames failed authentication (corrupt).
    sealed_puts: int
    opened_gets: int
    not_ours_misses: int
    auth_failures: int
    read_latency_sum_us: int
    write_latency_sum_us: int
    read_latency_hist: list[int]
    write_latency_hist: list[int]
    latency_bucket_bounds_us: list[float]
    backend: str
    #: Why the backend moves no more bytes; "" while it works.
    backend_error: str
    fixed_buffers: bool
    direct_io: bool
    fallbacks: list[str]
    inflight: int
    chunks: int
    filler_chunks: int
    # This namespace's chunk bytes; other namespaces' chunks under the same
    # roots, which count against capacity_bytes too (decision 0053), and
    # the evictions among them (also in evictions).
    used_bytes: int
    other_namespace_chunks: int
    other_namespace_bytes: int
    other_namespace_evictions: int
    segments_unlinked: int
    capacity_bytes: int
    configured_capacity_bytes: int
    min_free_bytes: list[int]
    backend_cpu_s: float
    chunk_worker_cpu_s: float
    scan_complete: bool
    open_scan_chunks: int
    open_scan_s: float
    open_scan_error: str
    staging_free_slots: int
    #: An encryption key is configured: every chunk written is sealed.
    sealing: bool
    #: Hex ids of the current and previous key (derived from the keys, never
    #: key bytes; "" without one).
    encryption_key_id: str
    encryption_previous_key_id: str
    #: Seal buffers, and those no sealed put holds now (0 without a key).
    seal_buffers: int
    seal_buffers_free: int
    #: Tenants whose derived keys are cached (at most 1024).
    sealed_tenants_cached: int
    # A stalled or failing storage directory (decision 0031): operations
    # abandoned past the I/O deadline, storage-failure errnos (EIO, ENOTCONN,
    # ESTALE...), circuit-breaker openings, probes and what the open breakers
    # refused; abandoned work that ended later, still stuck, and the staging
    # slots held back meanwhile.
    io_timeouts: int
    storage_errors: int
    breaker_opens: int
    breaker_skipped_gets: int
    breaker_skipped_puts: int
    breaker_probes: int
    breaker_probe_failures: int
    breaker_closes: int
    # Walks of the directories (refresh(), refresh_interval_s) for chunks
    # other nodes wrote (added, now counted) or removed (dropped).
    refreshes: int
    refresh_added: int
    refresh_dropped: int
    refresh_errors: int
    # "auto", "off" or "every <s> s" (refresh_interval_s); other writers'
    # live leases in the roots as last checked; times auto started walking.
    refresh_mode: str
    other_writers: int
    auto_refresh_starts: int
    late_completions: int
    stuck_ops: int
    quarantined_slots: int
    quarantine_releases: int
    breaker_open_dirs: int
    # Per storage directory, in order: "closed", "open" or "half-open".
    dir_states: list[str]
    io_deadline_s: float
    # By when the engine has settled every operation it started (one I/O
    # deadline more than the watchdog's hard bound; inf without a deadline).
    io_verdict_bound_s: float
    # Per namespace directory: what probing its filesystem found at open
    # (keys as probe_storage_dir returns them).
    storage_probes: dict[str, dict[str, bool]]

class PykvcacheError(Exception):
    """Base class of every error raised by the engine."""

class PoolExhausted(PykvcacheError, TimeoutError):
    """No staging slot became free within the timeout (backpressure)."""

class CorruptChunk(PykvcacheError):
    """A chunk failed verification (checksum, header, length, namespace or key)."""

class StoreError(PykvcacheError, OSError):
    """An OS-level failure (errno set where one applies: ENOENT, EACCES, ENOSPC, ...)."""

class BackendUnavailable(StoreError):
    """A requested backend or direct-I/O mode cannot be used here (policy forbids fallback)."""

@final
class StagingPool:
    """Bounded, page-aligned staging memory split into fixed-size slots.

    Each slot is ``HEADER_BYTES`` of header space followed by ``slot_bytes`` of
    payload. Memory never grows past ``total_bytes``. With ``shm_name`` the
    region is a named shared-memory file (``/dev/shm/<shm_name>``) that other
    processes map with :meth:`attach`; the name is removed by :meth:`close`,
    so a killed owner leaves it behind. With ``memfd=True`` as well, the region
    is an unnamed memfd labelled ``shm_name`` that other processes map with
    :meth:`attach_memfd`: never in /dev/shm, freed by the kernel when the last
    process holding it exits, however it exits. Shared memory is reserved in
    full at creation: more than /dev/shm or memory can give raises
    :class:`StoreError` (ENOSPC/ENOMEM) instead of a SIGBUS later.

    ``slot_bytes`` >= 1 and ``num_slots`` in 1..=65535; the whole pool must fit
    the address space (checked: a size that would wrap raises ``ValueError``).
    """

    def __new__(
        cls,
        slot_bytes: int,
        num_slots: int,
        *,
        shm_name: str | None = None,
        memfd: bool = False,
    ) -> StagingPool: ...
    @staticmethod
    def attach(shm_name: str) -> StagingPool:
        """Map a pool created by another process. The attached pool has no slot
        accounting of its own (acquire/release belong to the creator); use
        :meth:`region` and :meth:`payload_offset` to reach slot payloads."""
    @staticmethod
    def attach_memfd(shm_name: str) -> StagingPool:
        """:meth:`attach` for a ``memfd=True`` pool: opens its owner's fd
        through ``/proc/<pid>/fd``, looking in this process, its parent, then
        every process (where the name must be unique)."""
    @property
    def slot_bytes(self) -> int: ...
    @property
    def slot_stride(self) -> int:
        """Bytes from one slot's start to the next (header + payload, aligned)."""
    @property
    def num_slots(self) -> int: ...
    @property
    def total_bytes(self) -> int:
        """Bytes mapped (the hard budget)."""
    @property
    def base_address(self) -> int:
        """Address of the mapping in this process (for a one-time cudaHostRegister)."""
    @property
    def shm_name(self) -> str | None: ...
    @property
    def is_owner(self) -> bool: ...
    @property
    def is_memfd(self) -> bool:
        """Created here with ``memfd=True``."""
    @property
    def free_slots(self) -> int: ...
    @property
    def deferred_releases(self) -> int:
        """Slots released while their I/O was abandoned past its deadline: free
        once the kernel ends that I/O (never reused before)."""
    def payload_offset(self, slot: int) -> int:
        """Offset of ``slot``'s payload from ``base_address``."""
    def acquire(self, timeout: float | None = 0.0) -> int:
        """Take a free slot. Blocks (GIL released) up to ``timeout`` seconds
        (None, or above 1e9 = forever); raises :class:`PoolExhausted` after that."""
    def try_acquire(self) -> int | None: ...
    def release(self, slot: int) -> None:
        """Return a slot. Raises :class:`PykvcacheError` while a view of it is
        exported or I/O on it is in flight (nothing is recycled under a reader)."""
    def view(self, slot: int) -> memoryview:
        """Zero-copy, writable view of the slot payload (``slot_bytes`` long).
        The slot counts as exported until the memoryview is released."""
    def region(self) -> memoryview:
        """Zero-copy view of the whole mapping (for workers that copy rows)."""
    def exports(self, slot: int) -> int: ...
    def ready_state(self, slot: int) -> tuple[int, str]:
        """``(generation, state)`` of the slot's ready word, which a store's get
        arms (new generation, "pending") and settles with its verdict ("ready":
        read and verified; "failed"); "idle" if never armed. Shared by every
        process mapping the pool (decision 0055)."""
    def wait_ready(self, slots: list[int], generations: list[int], timeout: float) -> list[str]:
        """Waits (GIL released) until the read of ``generations[i]`` into
        ``slots[i]`` ended, all within ``timeout`` seconds: per slot "ready",
        "failed", "recycled" (the word holds another generation: never ready)
        or "timed_out"."""
    def close(self) -> None:
        """Unmap (refused while views are exported); the owner unlinks the shm file."""

@final
class SlotBuffer:
    """The buffer exporter behind ``StagingPool.view`` and ``StagingPool.region``
    (a slot stays exported while a memoryview of it lives); not constructed
    directly."""

@final
class IoResult:
    @property
    def status(self) -> Literal["ok", "miss", "corrupt", "error"]: ...
    @property
    def length(self) -> int:
        """Payload bytes transferred (0 unless ok)."""
    @property
    def errno(self) -> int | None: ...
    @property
    def message(self) -> str: ...
    @property
    def latency_s(self) -> float:
        """Submit-to-completion time."""
    @property
    def ok(self) -> bool: ...
    @property
    def miss_kind(self) -> Literal["absent", "kept", "unavailable", "corrupt"] | None:
        """A get that served nothing: what became of its chunk file, as the engine judged it.
        ``absent``: no file (the index forgot the key); ``kept``: a sound file this store does
        not serve (another writer's), left in place and indexed; ``unavailable``: the file could
        not be read (deadline, storage errno, open breaker, or status ``error``), untouched;
        ``corrupt``: failed verification, removed by the engine. None for puts and hits.
        Callers never delete a chunk file after a failed read (decision 0050)."""
    def raise_for_status(self) -> None:
        """Raise CorruptChunk / StoreError (or KeyError for a miss) unless ok."""

@final
class IoHandle:
    """One in-flight put or get. The staging slot stays pinned until it completes."""

    @property
    def op(self) -> Literal["put", "get", "prefetch"]: ...
    @property
    def key(self) -> bytes: ...
    @property
    def slot(self) -> int | None:
        """The staging slot; None for a region operation (``put_region``/``get_region``)."""
    def promote(self) -> bool:
        """A prefetch still waiting to start: raise it to demand priority (its
        transfers not started yet go with gets and puts, behind those queued
        before). True when something moved; False for a get or put, a prefetch
        done or promoted already, or one whose transfers all started (a read in
        flight is not recalled)."""
    def done(self) -> bool: ...
    def settled(self) -> bool:
        """Whether the operation's work really ended: no transfer of it touches
        its memory any more. Differs from :meth:`done` only for an operation the
        I/O deadline abandoned (done, its result a time-out, but the kernel may
        still land bytes until its directory answers). A region get's row is
        the caller's to reuse only once settled."""
    def wait(self, timeout: float | None = None) -> IoResult:
        """Block (GIL released) until complete; raises TimeoutError on timeout
        (None, or above 1e9 s = forever). Several threads may wait at once:
        each gets the same result."""

@final
class BlockStore:
    """Checksummed chunk store on one or more directories, driven by one I/O backend."""

    def __new__(
        cls,
        dirs: Sequence[str | PathLike[str]],
        pool: StagingPool,
        *,
        namespace: str,
        capacity_bytes: int,
        queue_depth: int = 32,
        backend: Literal["auto", "io_uring", "threads"] = "auto",
        direct_io: Literal["required", "optional", "disabled"] = "optional",
        register_buffers: bool = True,
        segment_bytes: int = 4 << 20,
        write_segment_bytes: int = 0,
        max_inflight: int = 1024,
        submit_timeout: float | None = 30.0,
        io_threads: int = 0,
        chunk_workers: int = 2,
        verify: Literal["full", "header"] = "full",
        recycle_files: bool = True,
        background_scan: bool = False,
        preallocate: bool = True,
        segment_files: bool | Literal["auto"] = "auto",
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
        allow_insecure_root: bool = False,
        min_free_bytes: int | None = None,
        min_free_fraction: float | None = None,
        io_deadline: float | None = None,
        refresh_interval_s: float | Literal["auto"] | None = "auto",
        encryption_key_file: str | PathLike[str] | None = None,
        encryption_previous_key_file: str | PathLike[str] | None = None,
        seal_buffers: int = 2,
    ) -> BlockStore:
        """Opens (or creates) the store and rebuilds its index from the files.
        Every keyword is described in docs/python-api.md ("``BlockStore``
        keywords"). Out-of-range values raise ``ValueError`` naming the argument
        (``ENGINE_LIMITS``); a key file others may read, an unusable directory
        or a mismatched layout raise before anything is written.
        ``capacity_bytes`` bounds each storage directory in total, every
        namespace and writer counted; lookups never see another namespace's
        chunk. With ``encryption_key_file`` every chunk is sealed (AES-256-GCM,
        decision 0083) and only chunks sealed with this key (or the previous
        one) for the operation's ``tenant`` are loaded; any other is a ``miss``
        of kind ``"kept"``, left in place."""
    def put(self, key: bytes, slot: int, length: int, *, tenant: bytes = b"") -> IoHandle:
        """Write ``length`` payload bytes of ``slot`` as chunk ``key``. Becomes
        visible atomically once complete; an existing chunk is success.
        ``length`` above ``slot_bytes`` is a ``ValueError``. A slot that already
        has I/O in flight raises :class:`PykvcacheError` (nothing is kept
        reserved by the refusal); on a closed store, or one closing while this
        call waits for an operation entry, raises :class:`PykvcacheError`
        ("store is closed"). An operation admitted just before a concurrent
        ``close()`` but not yet submitted completes with status ``error``
        and its slot unpinned. With an encryption key the chunk is sealed for
        ``tenant`` (ignored without a key; at most 1024 bytes)."""
    def get(self, key: bytes, slot: int, *, tenant: bytes = b"") -> IoHandle:
        """Read chunk ``key`` into ``slot`` and verify it. Status ``miss`` when
        absent, ``corrupt`` when verification fails (the file is then removed).
        With an encryption key, a chunk sealed for another ``tenant`` or with
        another key is a ``miss`` of kind ``"kept"``."""
    def prefetch(self, key: bytes, slot: int, *, tenant: bytes = b"") -> IoHandle:
        """``get`` at background priority, for chunks that will be needed soon:
        its transfers start only when no ``get``/``put`` transfer is waiting and
        never occupy more than half of ``queue_depth`` (nor, once set, more than
        :meth:`set_background_budget` bytes), so reads needed now overtake it.
        Same results and verification as ``get``; :meth:`IoHandle.promote`
        raises it to ``get`` priority."""
    def register_region(self, buffer: Buffer) -> int:
        """Register caller memory for :meth:`put_region` / :meth:`get_region`
        (decision 0062): a writable, C-contiguous buffer (a uint8 numpy array,
        a memoryview of shared memory). Returns the region's id. The store holds
        the buffer export until :meth:`unregister_region` (or until the store
        object is gone), so the memory cannot be freed or resized meanwhile;
        it never maps, unmaps or frees it. ``ValueError`` for a read-only or
        non-contiguous buffer; :class:`PykvcacheError` on a closed store."""
    def unregister_region(self, region: int, timeout: float | None = None) -> None:
        """Refuse new operations on ``region`` at once, wait for those in flight,
        then release its buffer. Raises :class:`PykvcacheError` for an id not
        registered, or after ``timeout`` seconds with operations left (the
        region stays retired and its buffer held: call again). Works on a
        closed store."""
    @property
    def region_count(self) -> int:
        """Regions registered (or retired with operations left)."""
    def put_region(self, key: bytes, region: int, offset: int, length: int, *, tenant: bytes = b"") -> IoHandle:
        """``put`` of bytes ``[offset, offset + length)`` of ``region``, written
        straight from there (no staging slot, no copy); the chunk header travels
        from a block of the engine's own, so the file is the one ``put`` writes.
        ``ValueError`` when the range leaves the region, ``length`` is not a
        positive multiple of 4096, or the address is not 4096-aligned (whatever
        the filesystem: a payload fills whole blocks on disk); the caller copies
        such rows through a slot instead. :class:`PykvcacheError` for a region
        not registered (or being unregistered) and on a closed store. The
        region's bytes must not change until the put completes. With an
        encryption key it is sealed into a seal buffer (the region is only
        read), so ``length`` may not exceed ``slot_bytes`` (``ValueError``)."""
    def get_region(self, key: bytes, region: int, offset: int, length: int, *, tenant: bytes = b"") -> IoHandle:
        """``get`` into bytes ``[offset, offset + length)`` of ``region`` (errors
        as :meth:`put_region`). Only the chunk's payload blocks are written
        there; a chunk larger than ``length`` is a ``miss`` (kept on disk).
        With ``verify="full"`` the payload is checksummed in place before the
        get is ``ok``; a ``corrupt`` chunk is removed and whatever landed in
        the range is the caller's to ignore."""
    def set_background_budget(self, nbytes: int | None) -> None:
        """Bound the bytes prefetches have in flight (one transfer always may):
        a ``get`` then waits at the device behind at most that much background
        work. ``None``: only half of ``queue_depth`` bounds them (the default).
        Applies to transfers started from now on (decision 0061)."""
    @property
    def background_budget(self) -> int | None:
        """What :meth:`set_background_budget` set last (None: never, or removed)."""
    def contains(self, key: bytes) -> bool:
        """Index lookup only (no I/O)."""
    def probe(self, key: bytes) -> bool:
        """Index lookup, then one ``lstat`` of the chunk path when the index has
        no entry: finds chunks published by another process sharing the
        directories since this store scanned, and indexes them."""
    def chunk_length(self, key: bytes) -> int | None: ...
    def evict(self, key: bytes) -> bool: ...
    def mark_filler(self, key: bytes) -> bool:
        """Make the chunk ``key`` a filler (see ``pykvcache.preformat``): first
        to be evicted (its file then recycled by a put), not counted in
        ``len()``; its mtime becomes the Unix epoch so later scans agree.
        False when the chunk is not indexed."""
    def wait_scan(self, timeout: float | None = None) -> bool:
        """Wait for the open-time index scan; False on timeout."""
    @property
    def scan_complete(self) -> bool: ...
    def rescan(self) -> int:
        """Rebuild the index from the directories; returns chunks found."""
    def refresh(self) -> tuple[int, int]:
        """Walk the directories and bring the index in line while serving:
        chunks others published (any namespace) are indexed, ranked by their
        modification time, and count against the capacity, chunks they removed leave the index, then
        eviction restores the capacity. Returns (added, dropped)."""
    def take_removed(self) -> tuple[list[int], int]:
        """Key hashes (``key_hash``) of chunks that left the index since the
        last call, oldest first, and how many the bounded log dropped."""
    def __len__(self) -> int:
        """Chunks indexed, fillers not counted."""
    @property
    def used_bytes(self) -> int: ...
    @property
    def committed_bytes(self) -> int:
        """Bytes of every namespace's chunks under the storage directories
        (``used_bytes`` plus ``stats()["other_namespace_bytes"]``) plus what
        puts in flight reserved: eviction weighs this against the capacity."""
    @property
    def capacity_bytes(self) -> int:
        """Capacity eviction enforces now: as configured, or lower once the
        filesystem filled up first (ENOSPC; logged once, see ``stats()``)."""
    @property
    def backend(self) -> Literal["io_uring", "threads"]: ...
    @property
    def backend_error(self) -> str | None:
        """Why the backend moves no more bytes (a fatal ``io_uring_enter``
        error), ``None`` while it works. After such a failure every pending
        operation completed with status ``"error"`` and new ones raise
        ``BackendUnavailable``; reopen the store."""
    @property
    def fixed_buffers(self) -> bool: ...
    @property
    def direct_io(self) -> bool:
        """Whether files are really opened with O_DIRECT."""
    @property
    def segment_files(self) -> bool:
        """Whether new chunks go into segment files (``segment_files`` as resolved at open)."""
    @property
    def namespace_dir(self) -> list[str]: ...
    @property
    def completion_fd(self) -> int:
        """eventfd that becomes readable when any operation completes (for asyncio)."""
    def inflight(self) -> int: ...
    def breaker_health(self) -> tuple[int, int, int]:
        """``(breaker_opens, breaker_closes, open_dirs)`` of :meth:`stats`, alone
        (cheap enough to ask once per request)."""
    def stats(self) -> StoreStats:
        """Every counter and state at once; logs the engine's notices first
        (``log_notices``)."""
    def log_notices(self) -> None:
        """Logs, on the ``pykvcache`` logger, what the engine noticed since
        the last call, each once at its level: a storage directory's circuit
        breaker changing state (opening: WARNING; probing, closing: INFO),
        ENOSPC lowering the capacity, another namespace's chunks evicted for
        the first time, a put refused for the free-space reserve (WARNING),
        and another writer found in the directories (INFO). ``stats()`` and
        ``close()`` call it too; ``put``, ``get``, ``prefetch`` and ``wait``
        never log."""
    def close(self) -> None:
        """Drain in-flight I/O, stop the backend, log the last notices
        (``log_notices``). Idempotent. Callers waiting for an operation entry
        fail at once ("store is closed"); only I/O already handed to the
        backend is waited for."""
    def __enter__(self) -> BlockStore: ...
    def __exit__(self, exc_type: object, exc: object, tb: object, /) -> None: ...
