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


def random_llama(**config):
    """A tiny LlamaForCausalLM with seeded random weights, its norms' scales drawn away from one (HF
    initialises them to one, where a mistake in applying them would not show)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model
