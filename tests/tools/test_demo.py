"""``pykvcache demo``: the command line's input checks. The demo itself (its vLLM part: one child process, vLLM without, then
with pykvcache, and the JSON it writes) runs once per suite, as `make demo`,
in tests/docs/test_readme_commands.py, which checks its output with
tests/helpers/demo_checks.py."""

from __future__ import annotations

from pykvcache.tools.cli import main


def test_demo_rejects_an_output_path_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    assert main(["demo", "--out", str(target), "--no-bench"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert target.read_text() == "x"


def test_a_missed_target_fails_the_demo_and_a_smoke_run_judges_none():
    """The demo printed two "missed" targets and exited 0. A missed target is a failed demo
    now (exit status 1 through run_demo); diagnostic rows and a smoke run (no measurement)
    judge nothing."""
    from pykvcache.tools.bench.parts import PartOutput
    from pykvcache.tools.demo import missed_targets

    fs_tier = PartOutput(
        name="fs_tier",
        title="pykvcache vs vLLM's filesystem tier",
        targets={
            ">= 1.0x fs tier everywhere (idle)": (True, "worst 1.37x"),
            ">= 1.5x fs tier under CPU contention": (False, "worst 1.02x"),
            "CPU-s/GB <= 1/4 of the fs tier's": (False, "worst 1.63x"),
        },
    )
    storage = PartOutput(
        name="storage",
        title="Engine vs fio",
        targets={"(diagnostic) first fill of an unformatted store (fresh files) >= 0.9x best fio": (False, "0.5x")},
    )
    skipped = PartOutput(name="lmcache", title="LMCache", skipped="not installed", targets={"cold loads >= 1.0x": (False, "-")})
    assert missed_targets([fs_tier, storage, skipped], measured=True) == [
        "pykvcache vs vLLM's filesystem tier: >= 1.5x fs tier under CPU contention (worst 1.02x)",
        "pykvcache vs vLLM's filesystem tier: CPU-s/GB <= 1/4 of the fs tier's (worst 1.63x)",
    ]
    assert missed_targets([fs_tier], measured=False) == []
    fs_tier.targets = {k: (True, why) for k, (_, why) in fs_tier.targets.items()}
    assert missed_targets([fs_tier, storage], measured=True) == []
