"""Every command line the README and docs/ show runs, as a user types it.

The shell blocks (```sh) of README.md and of every docs/**/*.md are parsed
here; each command must match one of the runners below, or this test fails
("a documented command no test runs" is how ``pykvcache calibrate`` once
shipped without existing). Command-line fragments that are not commands to
run belong in plain ``` blocks. Commands
that run for minutes are run with ``--help`` after their documented arguments
were parsed by the real parser (so a documented flag that does not exist fails
too). The Python example is ``examples/direct_api.py``: the README's Python
block must be an excerpt of it, and the file is run.

Placeholders: ``<model>`` becomes the tiny offline model, ``/mnt/nvme0/kv`` and
``/mnt/nvme1/kv`` temporary directories.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "direct_api.py"
BIN = Path(sys.executable).parent
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


#: The documents whose ```sh blocks are commands a user types.
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(lang: str, path: Path = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def readme_commands(path: Path = README) -> list[str]:
    commands = []
    for block in _blocks("sh", path):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def documented_commands() -> list[tuple[str, str]]:
    """(document, command) for every command of README.md and docs/, once each
    (the same command shown in two places is run once)."""
    seen: dict[str, str] = {}
    for path in DOCS:
        for command in readme_commands(path):
            seen.setdefault(command, str(path.relative_to(ROOT)))
    return [(doc, command) for command, doc in seen.items()]


def _command_id(item: tuple[str, str]) -> str:
    """``make_demo``, ``python_-m_vllm.entrypoints.openai.api_server``, ...: the
    first words without the environment, so ``-k`` can name a command."""
    doc, command = item
    name = "_".join(_split(command)[1][:4])
    return name if doc == "README.md" else f"{Path(doc).name}:{name}"


def _split(command: str) -> tuple[dict[str, str], list[str]]:
    """Leading NAME=value words are the environment, as in a shell."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("readme")
    return {"<model>": tiny_model, "/mnt/nvme0/kv": str(tmp / "nvme0"), "/mnt/nvme1/kv": str(tmp / "nvme1"), "tmp": str(tmp)}


def _substitute(words: list[str], placeholders: dict[str, str]) -> list[str]:
    out = []
    for w in words:
        for k, v in placeholders.items():
            if k != "tmp":
                w = w.replace(k, v)
        out.append(w)
    return out


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600, cwd=ROOT):
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", **(env or {}))
    full_env["PATH"] = f"{BIN}:{full_env.get('PATH', '')}"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    assert proc.returncode == 0, f"{shlex.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _make_recipe(target: str) -> list[str]:
    """The commands `make <target>` runs, without the prerequisites (dry run)."""
    out = _run(["make", "-n", "--no-print-directory", target]).stdout
    return [line for line in out.splitlines() if line.strip()]


def _parse_pykvcache(args: list[str]) -> None:
    """The documented arguments parse with the real parser; then --help runs."""
    from pykvcache.tools.cli import build_parser

    build_parser().parse_args(args)
    _run([str(BIN / "pykvcache"), args[0], "--help"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def _serve_openai(env: dict[str, str], words: list[str], placeholders: dict[str, str]) -> None:
    """Starts the documented OpenAI server for real, sends completions, reads /metrics."""
    port = _free_port()
    argv = [sys.executable if words[0] == "python" else words[0], *words[1:], "--host", "127.0.0.1", "--port", str(port)]
    log = Path(placeholders["tmp"]) / f"server-{port}.log"
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", **env)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            try:
                _http(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, f"server not healthy:\n{log.read_text()[-4000:]}"
                time.sleep(1)
        from pykvcache.testing.tiny_model import synthetic_text

        prompt = synthetic_text(200, seed=5)
        model = json.loads(_http(f"http://127.0.0.1:{port}/v1/models"))["data"][0]["id"]
        answers = [
            json.loads(
                _http(f"http://127.0.0.1:{port}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            )
            for _ in range(2)
        ]
        assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
        metrics = _http(f"http://127.0.0.1:{port}/metrics")
        assert "vllm:pykvcache_disk_writes" in metrics, "pykvcache's metrics are not exported"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _check_vllm_serve(words: list[str]) -> None:
    """``vllm serve`` is what GPU users type; the CPU build cannot run that
    console script (its distribution is ``vllm-cpu``, and the script asks for
    ``vllm``'s version), so here its arguments go through vLLM's own serve
    parser and pykvcache's validation of the connector config."""
    from pykvcache.vllm.config import parse_extra_config
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    args = parser.parse_args(words[1:])
    parse_extra_config(
        json.loads(args.kv_transfer_config.model_dump_json())["kv_connector_extra_config"]
        if hasattr(args.kv_transfer_config, "model_dump_json")
        else args.kv_transfer_config.kv_connector_extra_config
    )


def run_command(command: str, placeholders: dict[str, str]) -> str:
    env, words = _split(command)
    words = _substitute(words, placeholders)
    if words[:2] == ["make", "demo"]:
        from demo_checks import check_demo_output, plant_left_over

        plant_left_over(ROOT / "demo-out")
        # The storage benchmark at its smallest sizes: its code runs in full, its minutes of
        # measuring belong to `pykvcache bench` (tests/tools/test_bench_*.py check its numbers).
        proc = _run(["make", "demo"], {**env, "PYKVCACHE_DEMO_BENCH": "smoke"}, timeout=900)
        check_demo_output(ROOT / "demo-out")
        # Start-up notices that are true of a benchmark's engine-less tier and of a gate that is
        # off say nothing to a demo's reader (each printed once per tier before).
        for noise in ("VllmConfig was not found", "no gate profile configured"):
            assert noise not in proc.stdout + proc.stderr, noise
        return "ran"
    if words[:2] == ["make", "test"]:
        # CI (.ci/run) runs `make test` itself; here: its stages run both suites.
        recipe = "\n".join(_make_recipe("test"))
        assert "dev/test_stages.sh" in recipe, recipe
        stages = (ROOT / "dev" / "test_stages.sh").read_text()
        assert "cargo test --release --locked" in stages and "-m pytest -q -ra --durations=30" in stages
        return "recipe checked (CI runs it)"
    if words[:2] == ["make", "test-quick"]:
        # Its cargo tests and its pytest selection are a subset of `make test`'s, which CI runs
        # (running it here would run them twice); here: the selection it makes is collected by
        # pytest as typed in its recipe, and every test in it is an engine-free test of the suite.
        recipe = _make_recipe("test-quick")
        assert any(line.startswith("cargo test --release --locked") for line in recipe), recipe
        [line] = [line for line in recipe if "-m pytest" in line]
        args = shlex.split(line)[shlex.split(line).index("pytest") + 1 :]
        out = _run([sys.executable, "-m", "pytest", "--collect-only", *args], env).stdout
        selected = [t for t in out.splitlines() if "::" in t]
        assert len(selected) >= 300, out[-2000:]
        assert all(t.startswith(("tests/engine/", "tests/gate/", "tests/vllm/", "tests/docs/")) for t in selected)
        return f"selection collected: {len(selected)} tests (CI runs them in make test)"
    if words[0] == "make" and len(words) == 2:
        recipe = _make_recipe(words[1])
        tools = [shlex.split(line) for line in recipe if "pykvcache.tools.cli" in line]
        assert tools, f"make {words[1]} runs no pykvcache command: {recipe}"
        for tool in tools:
            _parse_pykvcache(tool[tool.index("pykvcache.tools.cli") + 1 :])
        return "recipe parsed, --help"
    if words[0] == "pykvcache":
        _parse_pykvcache(words[1:])
        return "parsed, --help"
    if words[:2] == ["python", "examples/direct_api.py"]:
        out = _run([sys.executable, *words[1:], os.path.join(placeholders["tmp"], "example")], env).stdout
        assert "get: ok" in out and "prefetch via asyncio: ok" in out
        return "ran"
    if words[:1] == ["python"] and words[1].startswith("scripts/gpu_"):
        out = _run([sys.executable, *words[1:]], env, timeout=900).stdout
        assert out.strip()
        return "ran"
    if words[:2] == ["pip", "install"] and words[-1] == ".":
        target = os.path.join(placeholders["tmp"], "pip-target")
        # The command is the subject, not a third build of every crate from scratch: the build
        # reuses the dependencies `cargo test` compiled into target/ (make test runs it before
        # pytest). Not target/maturin: `make wheel` builds there beside pytest, and two maturin
        # builds in one directory race on the library's rename.
        cargo = {"CARGO_TARGET_DIR": str(ROOT / "target")}
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, *words[2:]], {**env, **cargo}, timeout=900)
        assert list(Path(target, "pykvcache").glob("_core*.so")), "the wheel has no engine"
        return "installed into a scratch target"
    if words[:2] == ["vllm", "serve"]:
        _check_vllm_serve(words)
        return "parsed by vLLM's serve parser"
    if words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]:
        _serve_openai(env, words, placeholders)
        return "served completions"
    raise AssertionError(f"README or docs/ show a command no test runs: {command}")


def test_the_readme_shows_commands():
    commands = readme_commands()
    assert any(c.startswith("make demo") for c in commands)
    assert any(c.startswith("make test") for c in commands)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("documented", documented_commands(), ids=_command_id)
def test_every_readme_command_runs(documented, placeholders):
    print(run_command(documented[1], placeholders))


def test_the_python_example_in_the_readme_is_the_tested_file():
    example = [line.strip() for line in EXAMPLE.read_text().splitlines()]
    blocks = _blocks("python")
    assert blocks, "the README shows no Python example"
    for block in blocks:
        position = 0
        for line in block.splitlines():
            if not line.strip() or line.strip() == "...":
                continue
            try:
                position = example.index(line.strip(), position) + 1
            except ValueError:
                pytest.fail(f"README line not in examples/direct_api.py (in order): {line!r}")
