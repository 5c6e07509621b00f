"""Write a benchmark run to disk: report.md (tables, targets, figures),
one PNG per figure and results.json with every raw phase.

Each PNG carries the machine, the versions and the exact command in its own
footer, so a figure copied out of the report still says where it came from.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

from .config import BenchConfig
from .machine import MachineInfo
from .parts import Figure, PartOutput, Table

REPORT_MD = "report.md"
RESULTS_JSON = "results.json"
#: Key in a part's raw data: the seconds the part took (set by the runner).
PART_ELAPSED = "part_elapsed_s"


def markdown_table(t: Table) -> str:
    lines = [f"**{t.title}**", ""]
    lines.append("| " + " | ".join(t.header) + " |")
    lines.append("|" + "|".join("---" for _ in t.header) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in t.rows]
    if t.note:
        lines += ["", f"_{t.note}_"]
    return "\n".join(lines)


def caption(machine: MachineInfo) -> str:
    return f"{machine.one_line()}\n$ {machine.command}"


def save_figure(fig_spec: Figure, out_dir: Path, machine: MachineInfo) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=fig_spec.size)
    try:
        fig_spec.draw(fig)
        fig.suptitle(fig_spec.title)
        footer = "\n".join(textwrap.wrap(caption(machine), 150, break_long_words=True, replace_whitespace=False))
        fig.text(0.01, 0.005, footer, fontsize=6, va="bottom", ha="left", family="monospace")
        n_lines = footer.count("\n") + 1
        fig.tight_layout(rect=(0, 0.03 + 0.022 * n_lines, 1, 0.95))
        path = out_dir / fig_spec.filename
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def _targets_md(outputs: list[PartOutput]) -> list[str]:
    rows = [(name, met, why) for o in outputs for name, (met, why) in o.targets.items()]
    if not rows:
        return []
    lines = ["## Targets", "", "| target | met | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if met else '**no**'} | {why} |" for name, met, why in rows]
    return [*lines, ""]


def render_markdown(
    machine: MachineInfo, config: BenchConfig, outputs: list[PartOutput], figures: dict[str, list[Path]], elapsed_s: float
) -> str:
    m = machine
    dev = m.device
    lines = [
        "# pykvcache benchmark",
        "",
        f"Command: `{m.command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {elapsed_s:.0f} s",
        "",
        "## Machine",
        "",
        f"- CPU: {m.cpu_model}, {m.cores} cores; memory {m.memory_bytes / 2**30:.1f} GiB",
        f"- Kernel: Linux {m.kernel}; running as {'root' if m.is_root else 'non-root (caches not dropped)'}",
        f"- Filesystem: {m.fs_type} ({m.fs_source}; {m.fs_options})",
        f"- Device: {dev.describe() + f', scheduler {dev.scheduler}' if dev else 'not a block device'}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in m.versions.items() if v),
        "",
        *([f"**Warning:** {w}.", ""] if (w := m.busy_warning()) else []),
        "Numbers on shared or virtual disks move between runs; read the ratios, measured side by side in this run "
        "(systems interleaved, medians over repeats), before the absolute figures.",
        "",
        *_targets_md(outputs),
    ]
    for o in outputs:
        took = o.raw.get(PART_ELAPSED)
        lines += [f"## {o.title}", "", *([f"_Part `{o.name}`: {took:.0f} s._", ""] if took is not None else [])]
        if o.skipped:
            lines += [f"Skipped: {o.skipped}", ""]
            continue
        for note in o.notes:
            lines += [f"- {note}"]
        if o.notes:
            lines.append("")
        for t in o.tables:
            lines += [markdown_table(t), ""]
        for fig_spec, path in zip(o.figures, figures.get(o.name, [])):
            lines += [f"![{fig_spec.title}]({path.name})", "", f"_{fig_spec.title}. {m.one_line()}. Command: `{m.command}`_", ""]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, machine: MachineInfo, config: BenchConfig, outputs: list[PartOutput], elapsed_s: float) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: dict[str, list[Path]] = {}
    for o in outputs:
        if not o.skipped:
            figures[o.name] = [save_figure(f, out_dir, machine) for f in o.figures]
    raw: dict[str, Any] = {
        "machine": machine.to_dict(),
        "config": config.to_dict(),
        "elapsed_s": elapsed_s,
        "parts": {
            o.name: {
                "title": o.title,
                "skipped": o.skipped,
                "targets": {k: {"met": met, "measured": why} for k, (met, why) in o.targets.items()},
                "tables": [{"title": t.title, "header": t.header, "rows": t.rows} for t in o.tables],
                "notes": o.notes,
                "raw": o.raw,
            }
            for o in outputs
        },
    }
    (out_dir / RESULTS_JSON).write_text(json.dumps(raw, indent=1, default=str))
    report = out_dir / REPORT_MD
    report.write_text(render_markdown(machine, config, outputs, figures, elapsed_s))
    return report
