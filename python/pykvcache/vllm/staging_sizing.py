"""Is staging big enough for the prompts this engine accepts? Checked once at start.

vLLM loads a request's whole external prefix as one transfer, so every chunk
of it needs a staging slot at once, and the slots stay pinned until the copy
into the device cache ends. Staging that holds fewer than two full-length
prefixes therefore serializes long prompts: the next request's reads wait for
the previous request's copy, and its lookups answer RETRY meanwhile (the
serving benchmark measured 0.6-0.7 s of deferred lookup per request at 1.1
prefixes). Lookahead needs room beyond that: a preload that covers only part
of a prefix saves no scheduler step, because the request's lookup still waits
for the rest. The measured lookahead gain was 1.0 at 1.1 and 2.3 prefixes of
staging and 1.2-1.3 at 3.5 (docs/lookahead.md, "Sizing staging").

The check only advises (the engine runs either way): a too-small staging
costs speed, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

#: One prefix being copied into the device cache, one being read, one preloaded.
RECOMMENDED_PREFIXES = 3


@dataclass(frozen=True)
class StagingSizing:
    slots: int
    #: Chunks a prompt of ``max_model_len`` tokens can load (every KV group).
    prefix_chunks: int
    lookahead_slots: int
    slot_bytes: int

    @property
    def prefixes(self) -> float:
        """Full-length prefixes staging holds at once."""
        return self.slots / self.prefix_chunks if self.prefix_chunks else float("inf")

    @property
    def recommended_bytes(self) -> int:
        return RECOMMENDED_PREFIXES * self.prefix_chunks * self.slot_bytes

    def advice(self) -> list[str]:
        """Warnings for the start-up log; empty when staging is big enough."""
        if not self.prefix_chunks:
            return []
        rec = f"staging_bytes >= {self.recommended_bytes} ({self.recommended_bytes / (1 << 20):.0f} MiB)"
        out = []
        if self.slots < self.prefix_chunks:
            out.append(
                f"staging holds {self.slots} chunks, fewer than the {self.prefix_chunks} of one "
                f"full-length prompt: such a prompt loads at most {self.slots / self.prefix_chunks:.0%} "
                f"of its prefix from disk and recomputes the rest; give {rec}"
            )
        elif self.slots < 2 * self.prefix_chunks:
            out.append(
                f"staging holds {self.prefixes:.1f} full-length prefixes: loads of long prompts "
                f"serialize (each waits for the previous one's copy into the device cache); give {rec}"
            )
        if 0 < self.lookahead_slots < self.prefix_chunks:
            out.append(
                f"lookahead's budget ({self.lookahead_slots} chunks) covers less than one full-length "
                f"prefix ({self.prefix_chunks} chunks): preloads of long prompts are partial and save "
                f"no scheduler step; give {rec} or set lookahead_bytes"
            )
        return out


def staging_sizing(
    *, slots: int, slot_bytes: int, lookahead_slots: int, max_model_len: int | None, chunk_tokens: int, groups: int
) -> StagingSizing:
    # vLLM recomputes at least the last prompt token: a full-length prompt
    # loads (max_model_len - 1) // chunk_tokens chunks per group.
    per_group = max(0, (max_model_len or 0) - 1) // max(1, chunk_tokens)
    return StagingSizing(slots=slots, prefix_chunks=per_group * max(1, groups), lookahead_slots=lookahead_slots, slot_bytes=slot_bytes)
