"""What determines KV values, beyond the layout: the model's identity.

The same token ids give different KV when the resolved model configuration
changes (``--hf-overrides``, rope scaling, ``--revision``, ``--quantization``,
the compute dtype, KV-cache dtype and scales, remote modelling code) or when
the weights behind the same path change. Both go into the namespace, so a
store written under one never serves another (a miss, never stale KV).

Weights are identified by content, all of it: every KV-relevant file's name,
size and a digest of every byte (:mod:`pykvcache.vllm.identity.weights_digest`), so any
changed byte, however few and wherever, is a new namespace. Samples are not
enough: editing rows of an embedding in place kept a sampled identity (issue
24). The cost is reading the weights once (3–11 GB/s a core from the page
cache, where vLLM's own load has just put them; the disk's speed otherwise),
and only on the first start: a node's digest cache
(:mod:`pykvcache.vllm.identity.digest_cache`), keyed on each file's path, size, mtime,
ctime, inode and device, makes a restart on unchanged files a ``stat`` each.
Modification times and paths are not in the digest: nodes sharing a store
each have their own copy of the weights, with their own mtimes and inodes, and
must agree on the namespace (the namespace label still shows the model's
directory name). Decision 0052.

The digest is taken after vLLM has loaded the weights (nothing of ours runs
earlier); :mod:`pykvcache.vllm.identity.loaded_weights` confirms that no digested file
changed since before the load. Weights that are not the files on disk (a
file changed during the load, ``load_format="dummy"``'s random weights, a
loader that reads elsewhere) get a namespace of this engine's own: it loads
nothing another engine stored and stores nothing another engine will load.
Decision 0081.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pykvcache.vllm.identity.digest_cache import DigestCache, same_file_state
from pykvcache.vllm.identity.loaded_weights import DigestedFile, engine_started_ns, first_change
from pykvcache.vllm.identity.weights_digest import DIGEST_THREADS, PIECE_BYTES, file_digest

logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])

#: Bump when what the digests cover changes (old stores then become misses).
#: 2: every byte of the weights (1 sampled 4 KiB of each tensor).
#: 3: the load format, the speculative draft, sliding window, hash and mamba
#: state settings; weights not confirmed as loaded get a namespace of their own.
IDENTITY_VERSION = 3

#: Load formats whose loader reads the model's files (as digested): any of
#: them loads the same weights from the same bytes, so they share a namespace.
#: Every other one (``dummy``: random weights; ``tensorizer``, ``ipc_cache``,
#: ``modelexpress``: weights from elsewhere; a loader registered by a plugin)
#: gets a namespace of the engine's own.
FILE_LOAD_FORMATS = frozenset(
    {
        "auto",
        "hf",
        "safetensors",
        "pt",
        "npcache",
        "fastsafetensors",
        "instanttensor",
        "mistral",
        "sharded_state",
        "runai_streamer",
        "runai_streamer_sharded",
        "bitsandbytes",
        "gguf",
    }
)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".npz")
# Files that never change KV for given token ids (the tokenizer maps text to
# ids before any key exists; generation settings act after the logits).
_NOT_KV = (
    "tokenizer",
    "vocab",
    "merges",
    "special_tokens_map",
    "added_tokens",
    "generation_config",
    "chat_template",
    "preprocessor_config",
    "README",
)
# HF config keys that name where or with what the config was loaded, not what it is.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
    }
)


_DEFAULT_CACHE = object()


@dataclass(frozen=True)
class WeightsIdentity:
    digest: str  # sha256 hex over every file's name, size and content digest; "" = not found
    source: str  # the directory or file read, or why nothing was
    files: int
    files_cached: int  # files whose digest came from the node's digest cache (not read)
    bytes_hashed: int  # bytes read and digested this time
    seconds: float
    #: Each file as its digest saw it (what :func:`confirm_loaded` checks).
    digested: tuple[DigestedFile, ...] = ()


def _config_dict(config: Any) -> Any:
    if config is None:
        return None
    to_dict = getattr(config, "to_dict", None)
    data = to_dict() if callable(to_dict) else dict(vars(config))
    return _scrub(data)


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _scrub(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_scrub(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return _config_dict(value) if hasattr(value, "to_dict") else str(value)  # scrubbed there


def _fields(obj: Any, names: tuple[str, ...]) -> dict[str, str] | None:
    if obj is None:
        return None
    return {name: str(getattr(obj, name, None)) for name in names}


def config_identity(vllm_config: Any) -> dict[str, Any]:
    """Everything in the engine's configuration that changes KV values."""
    mc = vllm_config.model_config
    cache = vllm_config.cache_config
    text_config = getattr(mc, "hf_text_config", None)
    ident: dict[str, Any] = {
        # The resolved HF config: checkpoint config.json after --hf-overrides,
        # rope scaling, quantization_config, vLLM's own adjustments.
        "hf_config": _config_dict(mc.hf_config),
        "hf_text_config": None if text_config is mc.hf_config else _config_dict(text_config),
        "dtype": str(mc.dtype),
        "quantization": str(mc.quantization),
        "revision": str(mc.revision),
        "code_revision": str(getattr(mc, "code_revision", None)),
        "model_impl": str(getattr(mc, "model_impl", None)),
        "override_attention_dtype": str(getattr(mc, "override_attention_dtype", None)),
        # Later layers' KV depends on what earlier layers attended to.
        "disable_sliding_window": str(getattr(mc, "disable_sliding_window", None)),
        "quantization_config": str(getattr(mc, "quantization_config", None)),
        "cache_dtype": str(cache.cache_dtype),
        "calculate_kv_scales": str(getattr(cache, "calculate_kv_scales", None)),
        "kv_cache_dtype_skip_layers": str(getattr(cache, "kv_cache_dtype_skip_layers", None)),
        # Hybrid models' state (offloaded with the KV) is kept in these dtypes.
        "mamba_cache_dtype": str(getattr(cache, "mamba_cache_dtype", None)),
        "mamba_ssm_cache_dtype": str(getattr(cache, "mamba_ssm_cache_dtype", None)),
        # Another hash function gives the same tokens other keys: never share.
        "prefix_caching_hash_algo": str(getattr(cache, "prefix_caching_hash_algo", None)),
        # LoRA adapters are keyed by name in vLLM's block hashes; these settings
        # change how adapted KV is computed.
        "lora": _fields(
            getattr(vllm_config, "lora_config", None), ("max_lora_rank", "lora_dtype", "fully_sharded_loras", "lora_extra_vocab_size")
        ),
        # Images are keyed by content hash in the block hashes; processor
        # settings change the embeddings (and so the KV) of the same image.
        "multimodal": _fields(getattr(mc, "multimodal_config", None), ("mm_processor_kwargs", "language_model_only")),
        # A draft model (EAGLE, MTP, a small model) has KV layers of its own in
        # the chunks; its weights are digested as the target's are.
        "speculative": _speculative_identity(getattr(vllm_config, "speculative_config", None)),
    }
    return ident


def _speculative_identity(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    out: dict[str, Any] = {
        "fields": _fields(spec, ("method", "model", "revision", "quantization", "kv_cache_dtype", "num_speculative_tokens"))
    }
    draft = getattr(spec, "draft_model_config", None)
    if draft is not None:
        out["draft_hf_config"] = _config_dict(getattr(draft, "hf_config", None))
        out["draft_dtype"] = str(getattr(draft, "dtype", None))
    return out


def load_format(vllm_config: Any) -> str:
    """The engine's load format, lower case ("auto" when none is set)."""
    fmt = getattr(getattr(vllm_config, "load_config", None), "load_format", None) or "auto"
    return str(getattr(fmt, "value", fmt)).lower()


def resolve_weights(model: str, revision: str | None, download_dir: str | None = None) -> Path | None:
    """The local directory (or single file) vLLM loads ``model``'s weights
    from (a hub id: its snapshot in ``download_dir``, vLLM's ``--download-dir``,
    or the hub's cache)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True, cache_dir=download_dir))
    except Exception:  # not a hub id, or not downloaded: nothing local to read
        return None


def _is_kv_relevant_file(name: str) -> bool:
    if name.startswith("."):
        return False
    if name.endswith(_WEIGHT_SUFFIXES):
        return True
    if name.endswith((".json", ".py")):  # index, quantization configs, remote modelling code
        return not name.startswith(_NOT_KV)
    return False


def _digest_file(path: Path, cache: DigestCache | None, pool: _LazyPool) -> tuple[os.stat_result, str, bool]:
    """(the file's state, content digest, whether it came from the cache) of one file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        real = os.path.realpath(path)  # a hub snapshot links to its blobs
        if cache is not None:
            cached = cache.lookup(real, st)
            if cached is not None:
                return st, cached, True
        started_ns = time.time_ns()
        digest = file_digest(fd, st.st_size, pool.get() if st.st_size > PIECE_BYTES else None)
        if not same_file_state(st, os.fstat(fd)):
            # Written while being read: the digest is of no version of the
            # file (a namespace nobody shares, never stale KV); not cached.
            logger.warning("pykvcache: %s changed while its digest was computed", path)
        elif cache is not None:
            cache.record(real, st, digest, started_ns)
        return st, digest, False
    finally:
        os.close(fd)


class _LazyPool:
    """The digest threads, started only when a large file misses the cache."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="pykvcache-digest")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def weights_identity(source: Path | None, cache: Any = _DEFAULT_CACHE) -> WeightsIdentity:
    """Content digest of the weights at ``source`` (see the module docstring).
    ``cache``: the node's :class:`DigestCache` by default; ``None`` reads every
    byte every time."""
    started = time.perf_counter()
    if source is None:
        return WeightsIdentity("", "not found locally", 0, 0, 0, 0.0)
    if cache is _DEFAULT_CACHE:
        cache = DigestCache.default()
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file() and _is_kv_relevant_file(p.name))
    else:
        files = [source]
    combined = hashlib.sha256()
    cached = hashed = 0
    digested = []
    pool = _LazyPool()
    try:
        for path in files:
            st, digest, from_cache = _digest_file(path, cache, pool)
            digested.append(DigestedFile(path, st))
            size = st.st_size
            name = path.name.encode()
            combined.update(struct.pack("<Q", len(name)) + name + struct.pack("<Q", size))
            combined.update(bytes.fromhex(digest))
            cached += from_cache
            hashed += 0 if from_cache else size
    finally:
        pool.close()
    if cache is not None:
        cache.save()
    return WeightsIdentity(combined.hexdigest(), str(source), len(files), cached, hashed, time.perf_counter() - started, tuple(digested))


def own_namespace(reason: str) -> dict[str, str]:
    """The weights entry of an engine whose weights are not the files on disk
    (or not known to be): a nonce nobody else draws, so its chunks are its own."""
    return {"own": reason, "nonce": secrets.token_hex(16)}


def confirm_loaded(weights: WeightsIdentity, vllm_config: Any) -> str | None:
    """Why the digested files may not be the bytes this engine loaded (a file,
    link or directory changed since the engine's configuration was made), or
    None when they are. No engine (``vllm_config`` None): nothing was loaded."""
    if vllm_config is None or not weights.digest:
        return None
    since, origin = engine_started_ns(vllm_config)
    if since is None:
        return "no time before the load is known (neither the engine's configuration nor the process start)"
    why = first_change(Path(weights.source), weights.digested, since)
    return None if why is None else f"{why} (started: {origin})"


def model_identity(vllm_config: Any | None, model: str, *, fingerprint_weights: bool = True) -> dict[str, Any]:
    """The identity dict the namespace digest covers, and logs what it read."""
    ident: dict[str, Any] = {"version": IDENTITY_VERSION}
    revision = None
    if vllm_config is not None:
        ident["config"] = config_identity(vllm_config)
        revision = vllm_config.model_config.revision
    else:
        ident["config"] = None
        logger.warning(
            "pykvcache: the engine's VllmConfig was not found; the namespace covers the "
            "model's files but not --hf-overrides, --revision or --quantization "
            "(set namespace_salt when you change those)"
        )
    fmt = load_format(vllm_config)
    if fmt not in FILE_LOAD_FORMATS:
        # Checked before fingerprint_weights: with such a loader the files
        # (or the model's name) say nothing about the weights in memory.
        ident["weights"] = own_namespace(f"load_format={fmt}")
        logger.warning(
            "pykvcache: load_format=%s does not load the weights from the model's files "
            "(dummy: random weights); this engine's chunks get a namespace of its own: it "
            "loads nothing other engines stored, and they load nothing it stores",
            fmt,
        )
        return ident
    if not fingerprint_weights:
        ident["weights"] = "not fingerprinted (fingerprint_weights: false)"
        return ident
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    ident["weights"] = _weights_entry(vllm_config, model, revision, download_dir)
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "model", None)
    if isinstance(draft, str) and draft and draft != model:
        ident["draft_weights"] = _weights_entry(vllm_config, draft, getattr(spec, "revision", None), download_dir)
    return ident


def _weights_entry(vllm_config: Any, model: str, revision: str | None, download_dir: str | None) -> Any:
    """The digest of ``model``'s files; a namespace of the engine's own when
    they changed since before the engine loaded them; the name and revision
    when there are no local files."""
    weights = weights_identity(resolve_weights(model, revision, download_dir))
    if not weights.digest:
        # Nothing local to read (weights streamed from object storage, say):
        # the name and revision are all there is; a change under the same
        # name needs namespace_salt.
        logger.warning(
            "pykvcache: the weights of %s were not found locally; the namespace covers "
            "the model name and revision only (set namespace_salt when the weights "
            "behind that name change)",
            model,
        )
        return {"model": model, "revision": str(revision)}
    logger.info(
        "pykvcache: weights identity of %s: %d file(s), %d from the digest cache, %d bytes hashed in %.2f s (%.0f MB/s)",
        weights.source,
        weights.files,
        weights.files_cached,
        weights.bytes_hashed,
        weights.seconds,
        weights.bytes_hashed / max(weights.seconds, 1e-9) / 1e6,
    )
    why = confirm_loaded(weights, vllm_config)
    if why is None:
        return weights.digest
    logger.warning(
        "pykvcache: the weights of %s changed while this engine started (%s): the weights "
        "it loaded may not be the files there now, so its chunks get a namespace of its "
        "own (it loads nothing other engines stored, and they load nothing it stores); "
        "restart it to share the store again",
        weights.source,
        why,
    )
    return own_namespace(why)
