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
