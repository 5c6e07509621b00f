"""Where the child-process scripts live: tests start them by path
(``child("driver.py")``) so that a crash or a hang stays in the child."""

from pathlib import Path

CHILDREN = Path(__file__).resolve().parent


def child(name: str) -> str:
    path = CHILDREN / name
    if not path.is_file():
        raise FileNotFoundError(f"no child script {name} in {CHILDREN}")
    return str(path)
