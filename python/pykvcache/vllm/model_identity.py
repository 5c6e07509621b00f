"""What determines KV values, beyond the layout: the model's identity.

The same token ids give different KV when the resolved model configuration
changes (``--hf-overrides``, rope scaling, ``--revision``, ``--quantization``,
the compute dtype, KV-cache dtype and scales, remote modelling code) or when
the weights behind the same path change. Both go into the namespace, so a
store written under one never serves another (a miss, never stale KV).

Weights are identified by content, cheaply: every file's name and size, the
whole safetensors header (tensor names, dtypes, shapes, offsets), and three
4 KiB samples of every tensor (its start, middle and end). A fine-tune or a
merged LoRA rewrites whole tensors, so a sample of each tensor sees it; the
cost is three small reads per tensor (a 70B Llama checkpoint has ~720 tensors:
~2,200 reads, ~9 MiB). Files in other formats (``.bin``, ``.pt``, ``.gguf``)
get 64 evenly spaced 64 KiB samples each. Modification times are left out on
purpose: nodes sharing a store each have their own copy of the weights, with
their own mtimes, and must agree on the namespace. The path itself is left
out of the digest for the same reason (the namespace label still shows the
model's directory name).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllm.pykvcache." + __name__.rsplit(".", 1)[-1])

#: Bump when what the digests cover changes (old stores then become misses).
IDENTITY_VERSION = 1

SAMPLE_BYTES = 4096
BLOB_SAMPLES = 64
BLOB_SAMPLE_BYTES = 64 << 10
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".npz")
# Files that never change KV for given token ids (the tokenizer maps text to
# ids before any key exists; generation settings act after the logits).
_NOT_KV = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens",
           "generation_config", "chat_template", "preprocessor_config", "README")
# HF config keys that name where or with what the config was loaded, not what it is.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version",
                                   "_commit_hash", "_attn_implementation",
                                   "_attn_implementation_autoset", "_attn_implementation_internal"})


@dataclass(frozen=True)
class WeightsIdentity:
    digest: str       # sha256 hex of everything sampled, "" when the weights were not found
    source: str       # the directory or file read, or why nothing was
    files: int
    tensors: int
    reads: int
    bytes_read: int
    seconds: float


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
        "cache_dtype": str(cache.cache_dtype),
        "calculate_kv_scales": str(getattr(cache, "calculate_kv_scales", None)),
        # LoRA adapters are keyed by name in vLLM's block hashes; these settings
        # change how adapted KV is computed.
        "lora": _fields(getattr(vllm_config, "lora_config", None),
                        ("max_lora_rank", "lora_dtype", "fully_sharded_loras", "lora_extra_vocab_size")),
        # Images are keyed by content hash in the block hashes; processor
        # settings change the embeddings (and so the KV) of the same image.
        "multimodal": _fields(getattr(mc, "multimodal_config", None),
                              ("mm_processor_kwargs", "language_model_only")),
    }
    return ident


def resolve_weights(model: str, revision: str | None) -> Path | None:
    """The local directory (or single file) vLLM loads ``model``'s weights from."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
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


class _Sampler:
    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.reads = 0
        self.bytes = 0

    def read(self, fd: int, offset: int, length: int) -> bytes:
        data = os.pread(fd, length, offset)
        self.reads += 1
        self.bytes += len(data)
        return data

    def add(self, *parts: bytes) -> None:
        for part in parts:
            self.hash.update(struct.pack("<Q", len(part)))
            self.hash.update(part)


def _sample_safetensors(fd: int, size: int, sampler: _Sampler) -> int:
    head = sampler.read(fd, 0, 8)
    if len(head) < 8:
        raise ValueError("shorter than a safetensors header")
    header_len = struct.unpack("<Q", head)[0]
    if header_len > min(size - 8, 100 << 20):
        raise ValueError("implausible safetensors header length")
    header = sampler.read(fd, 8, header_len)
    sampler.add(header)
    tensors = json.loads(header)
    data_start = 8 + header_len
    count = 0
    for name in sorted(k for k in tensors if k != "__metadata__"):
        begin, end = tensors[name]["data_offsets"]
        length = end - begin
        if length <= 0:
            continue
        count += 1
        offsets = sorted({0, max(0, length // 2 - SAMPLE_BYTES // 2), max(0, length - SAMPLE_BYTES)})
        for off in offsets:
            sampler.add(sampler.read(fd, data_start + begin + off, min(SAMPLE_BYTES, length - off)))
    return count


def _sample_blob(fd: int, size: int, sampler: _Sampler) -> None:
    if size <= BLOB_SAMPLES * BLOB_SAMPLE_BYTES:
        sampler.add(sampler.read(fd, 0, size))
        return
    step = (size - BLOB_SAMPLE_BYTES) // (BLOB_SAMPLES - 1)
    for i in range(BLOB_SAMPLES):
        sampler.add(sampler.read(fd, i * step, BLOB_SAMPLE_BYTES))


def weights_identity(source: Path | None) -> WeightsIdentity:
    """Content digest of the weights at ``source`` (see the module docstring)."""
    started = time.perf_counter()
    if source is None:
        return WeightsIdentity("", "not found locally", 0, 0, 0, 0, 0.0)
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file() and _is_kv_relevant_file(p.name))
    else:
        files = [source]
    sampler = _Sampler()
    tensors = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            sampler.add(path.name.encode(), struct.pack("<Q", size))
            if path.suffix == ".safetensors":
                try:
                    tensors += _sample_safetensors(fd, size, sampler)
                    continue
                except (ValueError, KeyError, TypeError):
                    pass  # not parseable as safetensors: sample it as bytes
            if path.suffix in (".json", ".py"):
                sampler.add(sampler.read(fd, 0, size))
            else:
                _sample_blob(fd, size, sampler)
        finally:
            os.close(fd)
    return WeightsIdentity(sampler.hash.hexdigest(), str(source), len(files), tensors,
                           sampler.reads, sampler.bytes, time.perf_counter() - started)


def model_identity(vllm_config: Any | None, model: str, *, fingerprint_weights: bool = True) -> dict[str, Any]:
    """The identity dict the namespace digest covers, and logs what it read."""
    ident: dict[str, Any] = {"version": IDENTITY_VERSION}
    revision = None
    if vllm_config is not None:
        ident["config"] = config_identity(vllm_config)
        revision = vllm_config.model_config.revision
    else:
        ident["config"] = None
        logger.warning("pykvcache: the engine's VllmConfig was not found; the namespace covers the "
                       "model's files but not --hf-overrides, --revision or --quantization "
                       "(set namespace_salt when you change those)")
    if not fingerprint_weights:
        ident["weights"] = "not fingerprinted (fingerprint_weights: false)"
        return ident
    weights = weights_identity(resolve_weights(model, revision))
    if weights.digest:
        ident["weights"] = weights.digest
        logger.info("pykvcache: weights identity of %s: %d file(s), %d tensor(s), %d reads, "
                    "%.1f MiB in %.2f s", weights.source, weights.files, weights.tensors,
                    weights.reads, weights.bytes_read / (1 << 20), weights.seconds)
    else:
        # Nothing local to read (weights streamed from object storage, say):
        # the name and revision are all there is; a change under the same
        # name needs namespace_salt.
        ident["weights"] = {"model": model, "revision": str(revision)}
        logger.warning("pykvcache: the weights of %s were not found locally; the namespace covers "
                       "the model name and revision only (set namespace_salt when the weights "
                       "behind that name change)", model)
    return ident
