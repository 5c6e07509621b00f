"""What the weights digest in the namespace costs at start-up, for a checkpoint
shaped like Llama-3.1-70B (80 layers, 723 tensors, bf16, 30 safetensors shards).

The shards are sparse files (real headers, holes for the tensor data), so the
run needs ~1 MB of disk and measures the digest's own work: reads issued,
bytes read, seconds (warm). For the cold cost, multiply the read count by the
device's 4 KiB random-read latency. Usage::

    python scripts/weights_identity_cost.py [--layers 80] [--shards 30]
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
from pathlib import Path

from pykvcache.vllm.model_identity import weights_identity

HIDDEN, INTERMEDIATE, VOCAB, KV = 8192, 28672, 128256, 1024  # Llama-3.1-70B


def llama_tensors(layers: int) -> list[tuple[str, list[int]]]:
    tensors = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors += [(p + "self_attn.q_proj.weight", [HIDDEN, HIDDEN]), (p + "self_attn.k_proj.weight", [KV, HIDDEN]),
                    (p + "self_attn.v_proj.weight", [KV, HIDDEN]), (p + "self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
                    (p + "mlp.gate_proj.weight", [INTERMEDIATE, HIDDEN]), (p + "mlp.up_proj.weight", [INTERMEDIATE, HIDDEN]),
                    (p + "mlp.down_proj.weight", [HIDDEN, INTERMEDIATE]), (p + "input_layernorm.weight", [HIDDEN]),
                    (p + "post_attention_layernorm.weight", [HIDDEN])]
    return tensors + [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]


def build_sparse_checkpoint(directory: Path, layers: int, shards: int) -> tuple[int, int]:
    """Writes the shards; returns (tensor count, checkpoint bytes)."""
    tensors = llama_tensors(layers)
    per = -(-len(tensors) // shards)
    total = 0
    for s in range(shards):
        header, offset = {}, 0
        for name, shape in tensors[s * per:(s + 1) * per]:
            size = 2  # bf16
            for dim in shape:
                size *= dim
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header).encode()
        with open(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + offset)  # a hole where the tensor data would be
        total += offset
    (directory / "config.json").write_text("{}")
    return len(tensors), total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--shards", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pykvcache-weights-") as tmp:
        count, size = build_sparse_checkpoint(Path(tmp), args.layers, args.shards)
        ident = weights_identity(Path(tmp))
    print(f"checkpoint: {size / 1e9:.1f} GB, {count} tensors, {args.shards} shards")
    print(f"digest: {ident.tensors} tensors sampled, {ident.reads} reads, "
          f"{ident.bytes_read / (1 << 20):.1f} MiB, {ident.seconds:.3f} s (warm)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
