"""The multi-turn session workload of the ``serve`` part (the one thing vLLM's
``bench serve`` lacks): users holding conversations over shared documents.

* ``documents`` long shared contexts (a system prompt / document each,
  ``doc_tokens`` long) are reused by many sessions: session ``i`` talks about
  document ``i % documents``.
* Each session has ``turns`` turns; turn ``k``'s prompt is the conversation so
  far (document, earlier questions and answers) plus a new question of
  ``question_tokens``. The answers in the history are fixed synthetic text of
  ``answer_tokens`` rather than the model's output, so every configuration
  serves the identical request sequence (TTFTs are comparable request by
  request) and a wrong load cannot change later prompts.
* ``concurrency`` users run sessions at once (a user starts the next session
  when one ends); each waits ``think_s`` (exponential, seeded) between turns.
  Above the server's ``max_num_seqs`` requests queue in vLLM.

Every request streams (``/v1/completions``, greedy, ``ignore_eos``, fixed
``output_tokens``) so TTFT (request sent -> first token) and inter-token
latencies are measured by the client; the usage block (``include_usage``,
``--enable-prompt-tokens-details``) gives the tokens served from a cache.
``reused_tokens`` is what the workload itself knows could be reused: the
longest block-aligned prefix of this prompt that an earlier request sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pykvcache.testing.tiny_model import synthetic_words


@dataclass
class Workload:
    sessions: int = 8
    turns: int = 3
    documents: int = 2
    doc_tokens: int = 1024
    question_tokens: int = 48
    answer_tokens: int = 32
    output_tokens: int = 16
    concurrency: int = 4
    think_s: float = 0.2
    seed: int = 0
    block_tokens: int = 32  # granularity of reuse bookkeeping (vLLM's block size)
    # Questions and answers from their own seed (None: drawn after the
    # documents from ``seed``): the same documents with new conversations, as
    # the serve part's steady-state phase sends after its cold one.
    question_seed: int | None = None
    # Prompts sent as token ids (the ids the text tokenizes to, no BOS added): a router that
    # keeps a prefix tree of token ids (vllm-router's cache_aware) routes only those.
    token_prompts: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Record:
    session: int
    turn: int
    document: int
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    text: str = ""
    error: str | None = None
    t_start: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TokenText:
    """Text of an exact token count from the model's own tokenizer. Pieces
    are whole space-led words, so a prompt's tokens are the concatenation of
    its pieces' tokens (byte-level BPE never merges across the space)."""

    def __init__(self, tokenizer_json: str, seed: int) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_json)
        self.rng = random.Random(seed)
        self.words = synthetic_words()

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def piece(self, tokens: int) -> str:
        """About ``tokens`` tokens of fresh text starting with a space."""
        out: list[str] = []
        n = 0
        while n < tokens:
            w = " " + self.rng.choice(self.words)
            out.append(w)
            n += self.count(w)
        return "".join(out)


def build_sessions(w: Workload, tokenizer_json: str) -> tuple[list[str], list[list[tuple[str, str]]]]:
    """The documents and, per session, its (question, answer) pieces."""
    tt = TokenText(tokenizer_json, w.seed)
    docs = [f"Document {d}." + tt.piece(w.doc_tokens) for d in range(w.documents)]
    if w.question_seed is not None:
        tt.rng = random.Random(w.question_seed)
    sessions = [
        [(" Question:" + tt.piece(w.question_tokens) + " Answer:", tt.piece(w.answer_tokens)) for _ in range(w.turns)]
        for _ in range(w.sessions)
    ]
    return docs, sessions


class ReuseIndex:
    """Block-aligned prefixes of prompts sent so far (the workload's view of
    what any cache could hold): reuse = the longest such prefix of a new prompt."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.seen: set[bytes] = set()

    def _hashes(self, ids: list[int]) -> list[bytes]:
        h = hashlib.sha256()
        out = []
        for i in range(0, len(ids) - len(ids) % self.block, self.block):
            h.update(json.dumps(ids[i : i + self.block]).encode())
            out.append(h.copy().digest())
        return out

    def add(self, ids: list[int]) -> int:
        hashes = self._hashes(ids)
        reused = 0
        for i, h in enumerate(hashes):
            if h not in self.seen:
                break
            reused = (i + 1) * self.block
        self.seen.update(hashes)
        return reused


async def _one_request(session: Any, url: str, model: str, prompt: str | list[int], w: Workload, rec: Record) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": w.output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    rec.t_start = time.time()
    last = None
    parts: list[str] = []
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:].strip()
                        if data == b"[DONE]":
                            continue
                        msg = json.loads(data)
                        now = time.perf_counter()
                        choices = msg.get("choices") or []
                        if choices and choices[0].get("text"):
                            if last is None:
                                rec.ttft_s = now - t0
                            else:
                                rec.itl_s.append(now - last)
                            last = now
                            parts.append(choices[0]["text"])
                            rec.output_tokens += 1
                        usage = msg.get("usage")
                        if usage:
                            details = usage.get("prompt_tokens_details") or {}
                            rec.cached_tokens = int(details.get("cached_tokens") or 0)
                            rec.output_tokens = int(usage.get("completion_tokens") or rec.output_tokens)
        rec.latency_s = time.perf_counter() - t0
        rec.text = "".join(parts)
    except Exception as e:  # one failed request is recorded, the run goes on
        rec.error = f"{type(e).__name__}: {e}"


async def _run(url: str, model: str, w: Workload, tokenizer_json: str, on_request: Any, index: ReuseIndex | None) -> list[Record]:
    import aiohttp
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    docs, sessions = build_sessions(w, tokenizer_json)
    index = index if index is not None else ReuseIndex(w.block_tokens)
    rng = random.Random(w.seed + 1)
    think = [[rng.expovariate(1 / w.think_s) if w.think_s > 0 else 0.0 for _ in range(w.turns)] for _ in range(w.sessions)]
    records: list[Record] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in range(w.sessions):
        queue.put_nowait(s)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)

    async def user(http: Any) -> None:
        while True:
            try:
                s = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            doc = s % w.documents
            history = docs[doc]
            for k, (question, answer) in enumerate(sessions[s]):
                prompt = history + question
                ids = tok.encode(prompt, add_special_tokens=False).ids
                bos = 0 if w.token_prompts else 1
                rec = Record(session=s, turn=k + 1, document=doc, prompt_tokens=len(ids) + bos, reused_tokens=index.add(ids))
                await _one_request(http, url, model, ids if w.token_prompts else prompt, w, rec)
                records.append(rec)
                on_request(rec)
                history = prompt + answer
                if k + 1 < w.turns and think[s][k] > 0:
                    await asyncio.sleep(think[s][k])

    # A fresh connection per request: a pooled keep-alive connection that sat
    # idle past the server's keep-alive timeout (uvicorn: 5 s) can be closed by
    # the server as it is reused, and the request fails with "Server
    # disconnected" before it reached vLLM (seen once in 72 requests of 8k-token
    # sessions, where users wait seconds between turns). A loopback connect
    # costs ~0.1 ms against TTFTs of 100 ms and more.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.gather(*(user(http) for _ in range(w.concurrency)))
    return records


def run_sessions(
    url: str, model: str, w: Workload, tokenizer_json: str, on_request: Any = lambda rec: None, index: ReuseIndex | None = None
) -> tuple[list[Record], float]:
    """Run the workload against a server; returns the records and the wall time.
    ``index``: the reuse bookkeeping of earlier runs against the same server
    (a later phase's ``reused_tokens`` then counts what they sent)."""
    t0 = time.perf_counter()
    records = asyncio.run(_run(url, model, w, tokenizer_json, on_request, index))
    return records, time.perf_counter() - t0
