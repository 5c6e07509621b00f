"""The PyO3 glue logs in one place, never on the I/O path.

The engine hands typed notices (level, text) to its caller; `rust/src/python/report.rs`
logs them, called from `stats()`, `log_notices()`, `close()` and opening a store. Put, get,
prefetch and wait must not reach Python's logging: a handler's I/O under the GIL would
stall vLLM's scheduler thread mid-step. Cheap: reads the sources.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GLUE = [ROOT / "rust" / "src" / "python.rs", *sorted((ROOT / "rust" / "src" / "python").glob("*.rs"))]


def test_only_report_rs_touches_python_logging():
    callers = [p.relative_to(ROOT).as_posix() for p in GLUE if re.search(r'"logging"|"getLogger"', p.read_text())]
    assert callers == ["rust/src/python/report.rs"], callers


def test_the_io_path_calls_no_logging_function():
    source = (ROOT / "rust" / "src" / "python.rs").read_text()
    for method in ("put", "get", "prefetch"):
        body = re.search(rf"\n    fn {method}\((.*?)\n    }}\n", source, re.S)
        assert body, method
        assert "log_notices" not in body.group(1) and "report::" not in body.group(1), f"BlockStore.{method} logs"
    io = (ROOT / "rust" / "src" / "python" / "io.rs").read_text()  # IoHandle.wait, IoResult
    assert "log_notices" not in io and "report::" not in io, "the wait path logs"
