"""Helpers shared by the core's tests (importable: pytest puts tests/ on sys.path)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: int = 300):
    """The real `python -m lmlab` in a subprocess (one thread: the machine has two cores)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)
