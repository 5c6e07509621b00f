"""The ``ttft`` part's plot: TTFT against prefix length per mode, with the
calibrated break-even and the measured crossover, one panel per storage."""

from __future__ import annotations

from typing import Any

from .parts import Figure


def ttft_figure(lengths: list[int], base: dict[str, Any], slow: dict[str, Any] | None, delay_s: float | None) -> Figure:
    def draw(fig: Any) -> None:
        panels: list[tuple[dict[str, Any], tuple[str, ...], str]] = [
            (base, ("recompute", "disk", "staging", "gated"), "this machine's disk")
        ]
        if slow is not None:
            panels.append(
                (slow, ("recompute", "slow_disk", "slow_gated"), f"emulated slow storage (+{(delay_s or 0) * 1e3:.0f} ms per load)")
            )
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        styles = {
            "recompute": ("recompute", "o-"),
            "disk": ("load from disk", "s-"),
            "staging": ("load from staging", "^-"),
            "gated": ("gated", "x--"),
            "slow_disk": ("load from slow disk", "s-"),
            "slow_gated": ("gated", "x--"),
        }
        for ax, (v, modes, title) in zip(axes, panels):
            med = v["medians"]
            for mode in modes:
                label, style = styles[mode]
                ax.plot(lengths, [med[(mode, n)] * 1e3 for n in lengths], style, label=label)
            if v["break_even"] is not None and lengths[0] <= v["break_even"] <= lengths[-1]:
                ax.axvline(v["break_even"], color="gray", ls=":", label="calibrated break-even")
            if v["kind"] == "at":
                ax.axvline(v["measured"], color="red", ls=":", label="measured crossover")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prefix tokens")
            ax.set_ylabel("TTFT ms (median)")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)

    return Figure("ttft_vs_prefix.png", "TTFT vs prefix length (recompute, load, gated)", draw, (11.0, 4.5))
