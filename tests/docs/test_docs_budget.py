"""The repository stays small and speaks of the product.

* docs/perf (the reports the docs cite) holds at most 3 MB, no tracked file
  is over 300 KB, and docs/perf holds no raw results, traces or server logs:
  a run's ``results.json``, traces and logs stay under the bench's ``--out``;
* every report under docs/perf is linked from a document: a report no
  document cites is a superseded run (git keeps it);
* no source file (Python and its stubs, Rust, shell) is over 600 lines: a longer one holds
  more than one subject, and is split by subject;
* no tracked file's name or text carries a label of the period of work it
  was written in (a document says what the product is, does and measured,
  with the date or commit of a figure; CHANGELOG.md is dated).

The files are the tracked ones (``git ls-files``), read from the working tree.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
PERF = "docs/perf/"

PERF_BUDGET_BYTES = 3_000_000
FILE_BUDGET_BYTES = 300_000
SOURCE_SUFFIXES = (".py", ".pyi", ".rs", ".sh")
SOURCE_BUDGET_LINES = 600
#: Source files over the line budget, each with why; nothing is added here lightly.
OVER_LINE_BUDGET: dict[str, str] = {}

#: What a report folder may hold: the report, its plots and tables. Raw
#: results (JSON), traces (JSON lines) and per-server logs are written under
#: the bench's --out and are not committed.
RAW_SUFFIXES = (".json", ".jsonl", ".gz", ".log")

#: Labels of a period of work, not of the product. Each pattern is narrow
#: enough not to meet the product's own words: the serving bench's
#: conversations are "sessions" of "turns" (``30 sessions of 3 turns``,
#: ``--serve-preset sessions``), upstream bugs are cited as ``owner/repo#N``.
LABELS = [
    re.compile(r"\bsessions?[ -]\d", re.I),  # a numbered work period
    re.compile(r"\bissues? #?\d{1,3}\b", re.I),  # a numbered task of this project
    re.compile(r"\bstop \d+(?: landed|:| did\b)", re.I),  # a numbered submission
    re.compile(r"\bopen after \d", re.I),
    re.compile(r"(?<![\w.])\(s\d{1,2}\)"),  # "(s16)", not a call such as f(s2)
]

#: The same labels in file and folder names: ``-s16-``, ``-aa18-``, ``session3``.
NAME_LABEL = re.compile(r"(?:^|[-_.])(?:s\d{1,2}[a-z]?|aa\d+|session[-_]?\d+)(?=$|[-_.])", re.I)


#: This file: its examples of labels are the detectors' test cases.
SELF = "tests/docs/test_docs_budget.py"


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def _text(path: str) -> str | None:
    data = (ROOT / path).read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def labels_in(text: str) -> list[str]:
    return [m.group(0) for pattern in LABELS for m in pattern.finditer(text)]


def name_labels(path: str) -> list[str]:
    return [part for part in PurePosixPath(path).parts if NAME_LABEL.search(part)]


# ---------------------------------------------------------------- the detectors


@pytest.mark.parametrize(
    "text",
    [
        # Built from parts so that no tracked line reads as a label itself.
        "the run of session" + " 13",
        "Sessions " + "18 and 19 measured",
        "the session-9 run",
        "(issue 24, finding 8)",
        "Issue 21 item 3",
        "stop 25 landed",
        "the stop 31: CI",
        "## Open after 20",
        "measured in (s16)",
    ],
)
def test_a_work_period_label_is_found(text):
    assert labels_in(text), text


@pytest.mark.parametrize(
    "text",
    [
        "30 sessions of 3 turns over 4 documents",
        "`--serve-preset sessions` (the default)",
        "--serve-set sessions=60",
        "p50, turns ≥ 2",
        "see vllm-project/vllm#12345",
        "the store stops 1 MiB short",
        "SIGTERM: default stop 52 of 106 answered",
        "2 MiB chunks (s3-compatible stores aside)",
        "pool.release(s2)",
    ],
)
def test_the_products_own_words_are_not_labels(text):
    assert not labels_in(text), text


def test_a_labelled_name_is_found():
    assert name_labels("docs/perf/serve-read25-s16-aa18-trace/report-serve.md")
    assert name_labels("docs/perf/serve-long-context-8k-read50-s14b/x.png")
    assert name_labels("notes/session3.md")
    assert not name_labels("docs/perf/serve-read25-gate-on-off/report-serve.md")
    assert not name_labels("rust/src/store/jobs.rs")


# ---------------------------------------------------------------- the repository


def test_the_listing_is_the_repository():
    # Guards the checks below: an empty listing would pass them all.
    files = tracked()
    assert "README.md" in files and "tests/docs/test_docs_budget.py" in files


def test_docs_perf_stays_within_its_budget():
    perf = {p: (ROOT / p).stat().st_size for p in tracked() if p.startswith(PERF)}
    total = sum(perf.values())
    largest = sorted(perf.items(), key=lambda kv: -kv[1])[:5]
    assert total <= PERF_BUDGET_BYTES, (
        f"docs/perf holds {total / 1e6:.1f} MB, over its {PERF_BUDGET_BYTES / 1e6:.0f} MB budget; "
        f"keep only the reports the docs cite (largest: {largest})"
    )


def test_no_tracked_file_is_over_the_file_budget():
    big = sorted((p, (ROOT / p).stat().st_size) for p in tracked() if (ROOT / p).stat().st_size > FILE_BUDGET_BYTES)
    assert not big, f"tracked files over {FILE_BUDGET_BYTES // 1000} KB: {big}"


def over_line_budget(files: list[str], root: Path = ROOT) -> list[tuple[str, int]]:
    """Source files among ``files`` (under ``root``) over the line budget, with their line counts."""
    counts = ((p, len((root / p).read_bytes().splitlines())) for p in files if p.endswith(SOURCE_SUFFIXES))
    return sorted((p, n) for p, n in counts if n > SOURCE_BUDGET_LINES)


def test_the_line_budget_finds_a_long_source_file(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (SOURCE_BUDGET_LINES + 1))
    (tmp_path / "short.rs").write_text("\n" * SOURCE_BUDGET_LINES)
    (tmp_path / "notes.md").write_text("\n" * (SOURCE_BUDGET_LINES + 1))
    assert over_line_budget(["long.py", "short.rs", "notes.md"], tmp_path) == [("long.py", SOURCE_BUDGET_LINES + 1)]


def test_no_source_file_is_over_the_line_budget():
    files = tracked()
    assert any(p.endswith(".rs") for p in files) and any(p.endswith(".sh") for p in files)
    long = [(p, n) for p, n in over_line_budget(files) if p not in OVER_LINE_BUDGET]
    assert not long, f"source files over {SOURCE_BUDGET_LINES} lines (split each by subject): {long}"
    stale = sorted(p for p in OVER_LINE_BUDGET if p not in dict(over_line_budget(files)))
    assert not stale, f"no longer over the line budget, remove from OVER_LINE_BUDGET: {stale}"


def test_docs_perf_holds_no_raw_results_traces_or_logs():
    raw = [p for p in tracked() if p.startswith(PERF) and p.endswith(RAW_SUFFIXES)]
    assert not raw, f"raw results, traces or logs committed under docs/perf (they belong under --out): {raw}"


def _linked_targets() -> set[str]:
    """Repository paths that the tracked Markdown outside docs/perf links to."""
    targets: set[str] = set()
    for doc in tracked():
        if not doc.endswith(".md") or doc.startswith(PERF):
            continue
        text = _text(doc) or ""
        for target in re.findall(r"\]\(([^)\s#]+)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            resolved = (ROOT / doc).parent.joinpath(target).resolve()
            if resolved.is_relative_to(ROOT):
                targets.add(resolved.relative_to(ROOT).as_posix().rstrip("/"))
    return targets


def test_every_report_under_docs_perf_is_linked_from_a_document():
    linked = _linked_targets()
    perf = [p for p in tracked() if p.startswith(PERF)]
    assert perf, "docs/perf holds no reports (the check below would pass vacuously)"
    reports = {p[len(PERF) :].split("/")[0] for p in perf if p.endswith(".md")}
    unlinked = sorted(r for r in reports if not any(t == PERF + r or t.startswith(PERF + r + "/") for t in linked))
    assert not unlinked, (
        f"reports under docs/perf that no document links (a superseded run: git keeps it; remove it with git rm): {unlinked}"
    )


def test_no_work_period_label_in_names_or_text():
    found = []
    for path in tracked():
        if path == SELF:
            continue
        found += [f"{path}: file or folder name {part!r}" for part in name_labels(path)]
        text = _text(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for label in labels_in(line):
                found.append(f"{path}:{n}: {label!r}")
    assert not found, (
        "labels of a period of work (say what the product does, with a date or commit):\n  "
        + "\n  ".join(found[:60])
        + (f"\n  ... and {len(found) - 60} more" if len(found) > 60 else "")
    )


def test_bench_outputs_are_ignored():
    """Every default --out of the benches and the Makefile's outputs are ignored."""
    outs = set(re.findall(r"--out (bench[\w-]*out)", (ROOT / "Makefile").read_text()))
    outs |= {"bench-out", "bench-serve-out", "demo-out", "gpu-bench-out", "serve-out"}
    probe = [f"{out}/report.md" for out in sorted(outs)]
    result = subprocess.run(["git", "check-ignore", "--no-index", *probe], cwd=ROOT, capture_output=True, text=True)
    ignored = set(result.stdout.split())
    assert set(probe) <= ignored, f"bench outputs not ignored by .gitignore: {sorted(set(probe) - ignored)}"
