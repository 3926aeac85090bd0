"""Conformance for parallel plugins' memory layouts: ``lmlab plan``'s estimate against a real run.

:func:`check_plan_matches_measured` plans a small model under the plugin (``Parallel.memory_layout``
and the planner's arithmetic), then trains it for a few steps through ``lmlab run``'s own code path,
one thread per process, and measures each process's peak resident set growth: the peak
(``ru_maxrss``, read after the last training step, before any checkpoint is written) minus the
resident set just before the run started building the model (after torch and Lightning were
imported), the largest over the processes. glibc's malloc is told to serve every allocation above
128 kB with its own mmap (``MALLOC_MMAP_THRESHOLD_``, which also stops glibc raising that threshold
as it does by default), so memory torch frees goes back to the system at once and the resident set
follows live tensors instead of the allocator's high-water marks. The estimate must be within
``tolerance`` of the measurement (the planner's promise is 20 %).

``bench/plan_vs_measured.py`` runs the same measurement on a larger model for every strategy.
"""

import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lmlab.api import hookimpl
from lmlab.testing.parallel import synthetic_corpus

MANIFEST = """
name = "plan-vs-measured"
seed = 1

[data]
use = "text-file"
path = "{data}"

[model]
n_layers = {layers}
d_model = {d_model}
n_heads = {heads}
block_size = {block}

[train]
max_steps = {steps}
batch_size = {batch}
eval_batch_size = 2
eval_every = 1000
eval_steps = 1
checkpoint_every = 1000
log_every = 1
warmup_steps = 1
sample_tokens = 0
threads = 1
{train_extra}

[parallel]
{parallel}

[tracker]
use = "none"
"""


@dataclass
class PlanMeasurement:
    devices: int  # processes the plan is for
    estimate: float  # bytes per device, lmlab plan's total
    measured: float  # bytes, the largest peak resident set growth over the processes
    params: int

    @property
    def ratio(self) -> float:
        return self.estimate / self.measured


def measure_plan(parallel_table: str, workdir: Path, *, train_extra: str = "", layers: int = 4, d_model: int = 512,
                 heads: int = 8, block: int = 256, batch: int = 4, steps: int = 3, corpus: Path | None = None,
                 timeout: int = 1800) -> PlanMeasurement:
    """Plan and train one model under ``parallel_table`` (a manifest's ``[parallel]`` table)."""
    from lmlab import manifest
    from lmlab.plan import plan_variant

    workdir.mkdir(parents=True, exist_ok=True)
    corpus = corpus or synthetic_corpus(workdir / "corpus.txt", size=100_000)
    path = workdir / "manifest.toml"
    path.write_text(MANIFEST.format(data=corpus, layers=layers, d_model=d_model, heads=heads, block=block,
                                    steps=steps, batch=batch, parallel=parallel_table, train_extra=train_extra))
    (variant,) = manifest.load(path)
    plan = plan_variant(variant)
    out = workdir / "measured"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run([sys.executable, "-m", "lmlab.testing.memory", str(path), str(out)],
                            capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"training under {parallel_table!r} failed:\n{result.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(ranks) == plan.device.layout.devices, (f"{plan.device.layout.devices} processes were planned, "
                                                      f"{len(ranks)} trained")
    measured = max(r["peak"] - r["baseline"] for r in ranks)
    return PlanMeasurement(plan.device.layout.devices, plan.device.total, measured, plan.facts.params)


def check_plan_matches_measured(parallel_table: str, workdir: Path, *, tolerance: float = 0.2,
                                **settings) -> PlanMeasurement:
    """:func:`measure_plan`, then require the estimate within ``tolerance`` of the measured peak."""
    m = measure_plan(parallel_table, workdir, **settings)
    assert abs(m.ratio - 1) <= tolerance, (
        f"lmlab plan estimates {m.estimate / 1e6:,.0f} MB per device under {parallel_table!r}; the run measured "
        f"{m.measured / 1e6:,.0f} MB (estimate / measured {m.ratio:.2f}, tolerance ±{tolerance:.0%})")
    return m


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """This process's own peak resident set: VmHWM, the high-water mark of its address space. Not
    getrusage's ru_maxrss, which Linux carries over an exec from the process that spawned this one
    (with vfork, the parent's whole peak): a test suite grown to a gigabyte would be measured here."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no VmHWM: Linux reports KiB


class _PeakProbe:
    """Writes this process's peak resident set after every training step (the last one wins)."""

    def __init__(self, out: Path, baseline: int):
        self.out, self.baseline = out, baseline

    @hookimpl
    def lmlab_train_batch_end(self, step, loss, model, log):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        peak = _peak_rss_bytes()
        (self.out / f"rank{rank}.json").write_text(json.dumps({"baseline": self.baseline, "peak": peak}))


def _worker(manifest_path: Path, out: Path) -> None:
    """One training process (Lightning re-runs this command for the other ranks)."""
    import lightning  # noqa: F401 — imported before the baseline: not the model's memory
    import torch  # noqa: F401

    from lmlab import manifest
    from lmlab.train import module, recorder, runner  # noqa: F401

    (variant,) = manifest.load(manifest_path)
    probe = _PeakProbe(out, _rss_bytes())
    runner.run_variant(variant, out / "run", extra_hooks=[probe])


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
