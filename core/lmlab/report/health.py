"""A run's health from what it recorded (metrics.jsonl, summary.json, warnings.log), judged against
the bands practitioners use: gradient norm about 0.1–10 (persistently below 0.01: learning rate too
small; above 100: too large, or bad data), the std of the last 100 training losses below 0.5,
data wait below 40 % of the step (utilisation under 60 % means an I/O or CPU bottleneck), and MFU
(above 100 % is impossible, so the peak it divides by is wrong; below 5 % the device mostly idles)."""

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from lmlab.rundir import read_metrics

GRAD_BAND = (0.1, 10.0)
GRAD_EXTREMES = (0.01, 100.0)
UNSTABLE_STD = 0.5
LOSS_WINDOW = 100
DATA_WAIT_LIMIT = 0.4
#: Below this MFU the device does little but wait: well-fed training reaches 30–50 % on GPUs.
LOW_MFU = 0.05


@dataclass
class Finding:
    name: str  # what was judged: "gradient norm", "loss smoothness", ...
    verdict: str  # "ok", "warning", "not recorded"; for MFU also "low" or "implausible"
    detail: str  # the figures, and what they mean

    def as_dict(self) -> dict:
        return {"name": self.name, "verdict": self.verdict, "detail": self.detail}


def health(run_dir: Path) -> list[Finding]:
    path = run_dir / "metrics.jsonl"
    records = read_metrics(path) if path.is_file() else []
    train = [r for r in records if "train_loss" in r]
    return [_grad_norm(train), _smoothness(train), _data_wait(train), _mfu(train)]


def _finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _grad_norm(train: list[dict]) -> Finding:
    norms = _finite(r.get("grad_norm") for r in train)
    if not norms:
        return Finding("gradient norm", "not recorded", 'add "grad-norm" to [monitor] use')
    low, high = GRAD_BAND
    outside = sum(not low <= v <= high for v in norms) / len(norms)
    median = statistics.median(norms)
    detail = (f"median {median:.3g}, range {min(norms):.3g}–{max(norms):.3g}; {outside:.0%} of {len(norms)} "
              f"logged steps outside {low:g}–{high:g}")
    recent = norms[-max(1, len(norms) // 4):]  # "persistently": the last quarter of the run
    if all(v < GRAD_EXTREMES[0] for v in recent):
        return Finding("gradient norm", "warning", f"{detail}; below {GRAD_EXTREMES[0]:g} for the last "
                       f"{len(recent)} logged steps: the learning rate is probably too small")
    if all(v > GRAD_EXTREMES[1] for v in recent):
        return Finding("gradient norm", "warning", f"{detail}; above {GRAD_EXTREMES[1]:g} for the last "
                       f"{len(recent)} logged steps: the learning rate is too large, or the data is bad")
    return Finding("gradient norm", "warning" if outside > 0.5 else "ok", detail)


def _smoothness(train: list[dict]) -> Finding:
    losses = _finite(r.get("train_loss") for r in train)[-LOSS_WINDOW:]
    if len(losses) < 2:
        return Finding("loss smoothness", "not recorded", "fewer than two logged training losses")
    std = statistics.pstdev(losses)
    detail = f"std of the last {len(losses)} logged training losses {std:.3f} (unstable above {UNSTABLE_STD})"
    if std > UNSTABLE_STD:
        return Finding("loss smoothness", "warning", f"{detail}: lower the learning rate or lengthen the warmup")
    return Finding("loss smoothness", "ok", detail)


def _data_wait(train: list[dict]) -> Finding:
    waits = _finite(r.get("data_wait") for r in train)
    if not waits:
        return Finding("data wait", "not recorded", 'add "throughput" to [monitor] use')
    median = statistics.median(waits)
    detail = f"median {median:.0%} of each step spent waiting for batches"
    if median > DATA_WAIT_LIMIT:
        return Finding("data wait", "warning", f"{detail}: an I/O or CPU bottleneck (prepare the data ahead, "
                       "or give the loader more threads)")
    return Finding("data wait", "ok", detail)


def _mfu(train: list[dict]) -> Finding:
    mfu = _finite(r.get("mfu") for r in train)
    if not mfu:
        return Finding("MFU", "not recorded", 'add "throughput" to [monitor] use')
    median = statistics.median(mfu)
    detail = f"median {median:.1%} of the device's peak FLOP/s"
    if median > 1.0:
        return Finding("MFU", "implausible", f"{detail}, more than the device can do: the peak FLOP/s estimate "
                       "is too low (on a CPU, measured while other work shared it; set [monitor.throughput] "
                       "peak_tflops to the real figure)")
    if median < LOW_MFU:
        return Finding("MFU", "low", f"{detail}: the device mostly waits (a model or micro-batch too small to "
                       "fill it, the data loader, host work between steps); try a larger train.batch_size, "
                       "bf16-mixed on a GPU, and see the data wait")
    return Finding("MFU", "ok", detail)
