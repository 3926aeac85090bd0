"""Whole-process timing of a training run: lmlab's CLI or the hand-written script, each a fresh
interpreter, timed from the parent as a user's shell would time it.

For each run: the wall time, the time to the first optimizer step (lmlab: the first record of
``metrics.jsonl``, written after step 1 with ``log_every = 1``; the script: its first ``step`` line;
with a longer log interval, the first logged step)
and the time from the last step to the process's exit (lmlab's closing evaluation over the whole
validation split, checkpoint and summary; the script has none). Steps are seen by polling every
5 ms, so the two step times are that precise.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


@dataclass
class Timed:
    wall: float
    first_step: float
    after_last: float
    # (step, seconds of training so far) as the process itself measured it: lmlab's metrics.jsonl
    # elapsed_s at each logged step, the script's every step.
    clock: list[tuple[int, float]] = field(default_factory=list)


def lmlab(steps: int, log_every: int = 1) -> Timed:
    """``log_every = 1`` sees every step (for the first one), at the cost of a loss sync and a
    metrics line per step; timing step costs, keep the hand-written script's 10."""
    with tempfile.TemporaryDirectory() as tmp:
        sets = ["tracker.use=none", "train.sample_tokens=0", f"train.max_steps={steps}", f"train.eval_every={steps}",
                "train.eval_steps=1", f"train.checkpoint_every={steps}", f"train.log_every={log_every}"]
        cmd = [sys.executable, "-m", "lmlab", "run", str(ROOT / "experiments" / "shakespeare-char.toml"),
               "--out", tmp, *[a for s in sets for a in ("--set", s)]]
        metrics = Path(tmp) / "default" / "metrics.jsonl"
        seen: list[float] = []
        start = time.perf_counter()
        process = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        count = 0
        while process.poll() is None:
            if metrics.exists():
                n = metrics.read_bytes().count(b'"train_loss"')
                if n > count:
                    seen += [time.perf_counter()] * (n - count)
                    count = n
            time.sleep(0.005)
        end = time.perf_counter()
        if process.returncode:
            raise SystemExit(f"lmlab run failed ({process.returncode})")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        clock = [(r["step"], r["elapsed_s"]) for r in records if "elapsed_s" in r]
    return Timed(end - start, seen[0] - start, end - seen[-1], clock)


def handwritten(steps: int) -> Timed:
    cmd = [sys.executable, str(ROOT / "bench" / "handwritten_train.py"), "--steps", str(steps)]
    seen: list[float] = []
    clock: list[tuple[int, float]] = []
    start = time.perf_counter()
    process = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def read():
        for line in process.stdout:
            if line.startswith("step "):
                seen.append(time.perf_counter())
                _, step, elapsed = line.split()
                clock.append((int(step), float(elapsed)))

    reader = threading.Thread(target=read)
    reader.start()
    process.wait()
    end = time.perf_counter()
    reader.join()
    if process.returncode:
        raise SystemExit(f"handwritten_train.py failed ({process.returncode})")
    return Timed(end - start, seen[0] - start, end - seen[-1], clock)


def import_time(module: str, runs: int = 5) -> float:
    """Median wall time of ``python -c "import module"`` in a fresh interpreter."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, env=ENV)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
