"""A tiny Llama model and tokenizer built offline, for tests, the demo and benchmarks.

No model hub is reachable where the tests run, so the model is generated:
random weights from a fixed seed, a byte-level BPE tokenizer trained on a
synthetic corpus. The result is cached under ``out_dir`` in a directory named
by a hash of everything that determines it, so every process (and every
vLLM worker) sees the same files and a rebuild happens only when the recipe
changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

#: Bump when the recipe below changes in a way the spec fields do not capture.
RECIPE_VERSION = 1

_WORDS_SEED = 1234
_MARKER = "tiny_model_complete.json"


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the generated model (and its cache key)."""

    vocab_size: int = 800
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    # Large weights make attention change the argmax visibly, so a test that
    # feeds the model wrong KV sees different tokens (the negative control).
    initializer_range: float = 0.2
    seed: int = 0
    corpus_sentences: int = 600

    def fingerprint(self) -> str:
        blob = json.dumps({"recipe": RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: Llama-3's KV geometry (8 KV heads of 128 dims, grouped-query attention) on
#: few layers and a small hidden size, so that a serving benchmark on a 2-core
#: machine moves KV chunks of a realistic shape per layer (4 KiB per token and
#: layer in float32: 4 layers = 16 KiB/token, vs 128 KiB/token for
#: Llama-3.1-8B's 32 layers in bf16) while prefill stays affordable. Random
#: weights; only the geometry is real.
LLAMA3_KV_GEOMETRY = TinyModelSpec(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, initializer_range=0.05,
)  # fmt: skip

#: The same model with room for 32k-token prompts (RoPE has no learnt
#: positions: only ``max_position_embeddings``, hence vLLM's accepted
#: ``max_model_len``, differs; the weights are the same seeded draw). Its own
#: cache directory, so the 8k model's fingerprint (and any gate profile
#: calibrated on it) stays valid. The serve part's long-context preset.
LLAMA3_KV_GEOMETRY_32K = replace(LLAMA3_KV_GEOMETRY, max_position_embeddings=32768)

#: Named specs (``pykvcache bench --parts serve --serve-model llama3-geometry``).
SPECS = {"tiny": TinyModelSpec(), "llama3-geometry": LLAMA3_KV_GEOMETRY, "llama3-geometry-32k": LLAMA3_KV_GEOMETRY_32K}


def synthetic_words(count: int = 400, seed: int = _WORDS_SEED) -> list[str]:
    """A fixed pseudo-vocabulary of lowercase words (3-9 letters)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 9))))
    return sorted(words)


def synthetic_text(num_words: int, seed: int) -> str:
    """Deterministic text over :func:`synthetic_words` (for prompts and the corpus)."""
    rng = random.Random(seed)
    vocab = synthetic_words()
    out = []
    for i in range(num_words):
        word = rng.choice(vocab)
        out.append(word + ("." if i % 12 == 11 else ""))
    return " ".join(out)


def _train_tokenizer(spec: TinyModelSpec, dest: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [synthetic_text(30, seed=i) for i in range(spec.corpus_sentences)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(dest)
    return fast


def _build_model(spec: TinyModelSpec, tokenizer, dest: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # A zero EOS row keeps its logit at 0 while random rows spread widely,
        # so greedy generation does not stop early.
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.save_pretrained(dest, safe_serialization=True)


def build_tiny_model(out_dir: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Build (or reuse) the tiny model under ``out_dir``; returns its directory.

    Safe to call from several processes at once: the model is built in a
    temporary directory and renamed into place; a loser of the race keeps the
    winner's copy.
    """
    spec = spec or TinyModelSpec()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tiny-llama-{spec.fingerprint()}"
    if (final / _MARKER).exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp is private; other users' processes read the model too
    try:
        tokenizer = _train_tokenizer(spec, tmp)
        _build_model(spec, tokenizer, tmp)
        (tmp / _MARKER).write_text(json.dumps(asdict(spec), sort_keys=True))
        try:
            tmp.rename(final)
        except OSError:
            if not (final / _MARKER).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build the tiny offline Llama model.")
    parser.add_argument("out_dir", help="cache directory (the model is a subdirectory)")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
