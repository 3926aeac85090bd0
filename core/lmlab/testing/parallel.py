"""Conformance for parallel plugins: N processes train exactly what one device would.

:func:`check_parallel_matches_single` trains a tiny model twice from the same manifest: on one
device with the global batch (``batch_size × data-parallel replicas``), and with the plugin under
test on ``processes`` CPU processes with ``batch_size`` each. lmlab draws each step's global batch
from (seed, step) and gives every replica its slice (``lmlab.train.batches``), so both runs see the
same data in the same order, and the logged training loss (averaged over ranks) must agree step by
step. Then ``lmlab generate`` must load the parallel run's checkpoint into a single-device model.
The one-device run is trained once per process for a given manifest and corpus: further checks of
the same configuration (another strategy, another stage) compare against a copy of it.

Tolerance: the two runs do the same arithmetic in a different order (a sum over the global batch
against an all-reduce of per-replica sums; sharded optimizer steps), so they agree to float32
rounding, which Adam's division by small second moments in the first steps can amplify over 20
steps; ``atol`` defaults to 1e-4 on losses of about 4, far below what a wrong gradient average,
a skipped replica or misaligned data would give (those differ by 1e-2 or more from the first step).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

MANIFEST = """
name = "parallel-check"
seed = 7

[data]
use = "text-file"
path = "{data}"

[tokenizer]
use = "char"

[model]
n_layers = 2
d_model = 32
n_heads = 4
block_size = 16
dropout = 0.0

[train]
max_steps = {steps}
batch_size = {batch_size}
warmup_steps = 2
eval_every = {steps}
eval_steps = 2
log_every = 1
checkpoint_every = {steps}
sample_tokens = 0

[tracker]
use = "none"
"""


def loss_trajectory(run_dir: Path) -> list[float]:
    """The logged training loss at every step of a run (metrics.jsonl, log_every = 1)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train_loss"] for r in records if "train_loss" in r]


def check_parallel_matches_single(parallel_table: str, workdir: Path, corpus: Path | None = None, *, replicas: int = 2,
                                  processes: int = 2, steps: int = 20, batch_size: int = 4,
                                  atol: float = 1e-4, extra_manifest: str = "", extra_train: str = "",
                                  timeout: int = 900) -> float:
    """Run the check; returns the largest loss difference, raises AssertionError on a mismatch.

    ``parallel_table`` is the manifest's ``[parallel]`` table for the plugin under test (e.g.
    ``'use = "ddp"\\ndevices = 2\\naccelerator = "cpu"'``); ``replicas`` is how many data-parallel
    replicas it makes of ``processes`` processes (fewer under tensor or pipeline parallelism). Without
    a ``corpus``, a 60 kB synthetic text is written into ``workdir``. ``extra_train`` adds lines to both
    runs' ``[train]`` table (``"grad_accum = 2"``); ``extra_manifest`` adds tables after the manifest.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    if corpus is None:
        corpus = synthetic_corpus(workdir / "corpus.txt")
    single = _write(workdir / "single.toml", corpus, steps, batch_size * replicas, extra_manifest, extra_train)
    parallel = _write(workdir / "parallel.toml", corpus, steps, batch_size,
                      f"{extra_manifest}\n[parallel]\n{parallel_table}\n", extra_train)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # N processes × N threads on N cores crawl
    if not _reuse_reference(single, corpus, workdir / "single"):
        _train(single, workdir / "single", env, timeout)
        _keep_reference(single, corpus, workdir / "single")
    _train(parallel, workdir / "parallel", env, timeout)
    # Losses that match would prove nothing if the plugin quietly trained on one process.
    took_part = json.loads((workdir / "parallel" / "default" / "summary.json").read_text()).get("processes")
    assert took_part == processes, f"{processes} processes were to train, {took_part} took part"
    expected = loss_trajectory(workdir / "single" / "default")
    actual = loss_trajectory(workdir / "parallel" / "default")
    assert len(expected) == len(actual) == steps, (len(expected), len(actual))
    worst = max(abs(a - b) for a, b in zip(actual, expected))
    assert worst <= atol, (f"{processes} processes diverge from one device by {worst:.2e} (tolerance {atol:g}):\n"
                           f"  single:   {[round(x, 5) for x in expected]}\n  parallel: {[round(x, 5) for x in actual]}")
    generated = subprocess.run([sys.executable, "-m", "lmlab", "generate", str(workdir / "parallel" / "default"),
                                "--prompt", "the ", "--max-new-tokens", "8"],
                               capture_output=True, text=True, env=env, timeout=timeout)
    assert generated.returncode == 0, f"generate could not load the checkpoint:\n{generated.stderr[-3000:]}"
    assert generated.stdout.startswith("the ") and len(generated.stdout.rstrip("\n")) > len("the ")
    return worst


# One-device reference runs already trained in this process, kept by what determines them: a suite that
# checks several strategies on the same manifest trains the reference once. Each is a private copy, so a
# caller that goes on to change its own folder changes no later caller's reference.
_REFERENCES: dict[str, Path] = {}


def _reference_key(manifest: Path, corpus: Path) -> str:
    import hashlib

    text = manifest.read_text().replace(str(corpus), "<corpus>")
    return hashlib.sha256(text.encode() + hashlib.sha256(corpus.read_bytes()).digest()).hexdigest()


def _keep_reference(manifest: Path, corpus: Path, run: Path) -> None:
    import atexit
    import shutil
    import tempfile

    copy = Path(tempfile.mkdtemp(prefix="lmlab-reference-")) / "run"
    shutil.copytree(run, copy)
    atexit.register(shutil.rmtree, copy.parent, ignore_errors=True)
    _REFERENCES[_reference_key(manifest, corpus)] = copy


def _reuse_reference(manifest: Path, corpus: Path, out: Path) -> bool:
    """Copies the reference for this manifest and corpus into ``out`` if this process trained it before."""
    import shutil

    kept = _REFERENCES.get(_reference_key(manifest, corpus))
    if kept is None or out.exists() or not (kept / "default" / "summary.json").is_file():
        return False
    shutil.copytree(kept, out)
    return True


def _train(manifest: Path, out: Path, env: dict, timeout: int) -> None:
    result = subprocess.run([sys.executable, "-m", "lmlab", "run", str(manifest), "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, f"{manifest.name} failed:\n{result.stderr[-4000:]}"


def synthetic_corpus(path: Path, size: int = 60_000, seed: int = 0) -> Path:
    """Lines of words drawn from a small vocabulary with Zipf-like frequencies: text a character
    model can learn something from within a few steps, so losses move and mismatches show."""
    import random

    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    words = ["".join(rng.choice(letters[:12 + i % 14]) for _ in range(2 + i % 6)) for i in range(300)]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    lines, total = [], 0
    while total < size:
        line = " ".join(rng.choices(words, weights, k=rng.randint(4, 12))) + "."
        lines.append(line)
        total += len(line) + 1
    path.write_text("\n".join(lines) + "\n")
    return path


def _write(path: Path, corpus: Path, steps: int, batch_size: int, extra: str, extra_train: str = "") -> Path:
    text = MANIFEST.format(data=corpus, steps=steps, batch_size=batch_size)
    path.write_text(text.replace("\n[train]\n", f"\n[train]\n{extra_train}\n", 1) + extra)
    return path
