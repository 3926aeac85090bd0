"""Model FLOPs utilisation (MFU) and the share of each step spent waiting for data.

MFU is the FLOP/s a run achieves with the model's own arithmetic, divided by the device's peak
(Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
https://arxiv.org/abs/2204.02311, appendix B). The FLOPs of one training token are estimated as
PaLM does it:

    6·N + 12·n_layers·d_model·block_size

``6·N``: a multiply-add (2 FLOPs) per weight per token forward, twice that backward (Kaplan et al.
2020, https://arxiv.org/abs/2001.08361, section 2.1). ``N`` counts every parameter that multiplies
an activation: all of them except the token and position embeddings, which are looked up, not
multiplied; a head that shares its weight with the token embedding multiplies, so it counts. The
second term is attention's two matmuls (scores and the weighted sum of values), which no weight
counts. Recomputation (activation checkpointing) is not counted: MFU measures the model's
arithmetic, not the hardware's (that would be HFU). The estimate assumes a transformer: for a
mixer without attention (a state-space model) the second term overstates the work.

The peak: ``peak_tflops`` when set; on an NVIDIA GPU, the vendor's dense (no sparsity) figure for
the precision the run computes in, from a table; on a CPU, a float32 matmul benchmark measured once
per CPU model and thread count and cached in ``$LMLAB_CACHE/throughput/cpu-peak.json``
(``~/.cache/lmlab`` without ``LMLAB_CACHE``), before training starts so it is not timed as a step.

The data wait: ``StepTiming.data_wait_s / step_s`` per step, averaged over the steps between two
logging steps. The core counts as waiting everything outside the training step, so the step after
an evaluation or a checkpoint waits long; the warning therefore judges the median step of the last
``WAIT_SPAN`` steps (once at least ``WAIT_MIN_STEPS`` of them are seen), which such steps do not
move, and leaves out the first logging window (the data loader starting up).
"""

import json
import os
import platform
import statistics
import time
from collections import deque
from pathlib import Path

import torch

from lmlab.api import Field, Monitor, Options, hookimpl, resolve_devices

# Dense peaks in TFLOP/s (no structured sparsity): (16-bit tensor cores with float32 accumulation,
# TF32 tensor cores, plain FP32). From NVIDIA's datasheets, which print the sparse figures, twice
# these, for the tensor cores:
#   H100 SXM5/PCIe/NVL  https://www.nvidia.com/en-us/data-center/h100/ (datasheet table)
#   H200 (SXM and NVL)  https://www.nvidia.com/en-us/data-center/h200/ (the H100's compute)
#   A100 (SXM and PCIe) https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
#   L4                  https://www.nvidia.com/en-us/data-center/l4/
#   L40, L40S           https://www.nvidia.com/en-us/data-center/l40/, .../l40s/
#   A10                 https://www.nvidia.com/en-us/data-center/products/a10-gpu/ (AWS's A10G has no
#                       datasheet of its own; AWS describes it as an A10 variant, so the A10's figures)
#   V100 (SXM2, PCIe, V100S) https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
#                       (no bf16 or TF32: its fp16 tensor-core peak, and FP32)
#   RTX 4090            NVIDIA Ada GPU architecture whitepaper, appendix table (BF16 with FP32 accumulate)
GPU_PEAKS: dict[str, tuple[float, float, float]] = {
    "H100": (989.4, 494.7, 66.9),  # the SXM5 part ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": (756.5, 378.0, 51.2),
    "H100 NVL": (835.5, 417.5, 60.0),
    "H200": (989.4, 494.7, 66.9),
    "H200 NVL": (835.5, 417.5, 60.0),
    "A100": (312.0, 156.0, 19.5),
    "L4": (121.0, 60.0, 30.3),
    "L40": (181.0, 90.5, 90.5),
    "L40S": (362.0, 183.0, 91.6),
    "A10": (125.0, 62.5, 31.2),
    "A10G": (125.0, 62.5, 31.2),
    "V100": (125.0, 15.7, 15.7),  # SXM2
    "V100-PCIE": (112.0, 14.0, 14.0),
    "V100S": (130.0, 16.4, 16.4),
    "RTX 4090": (165.2, 82.6, 82.6),
}

SIXTEEN_BIT = ("bf16-mixed", "bf16-true", "16-mixed")
WAIT_SPAN, WAIT_MIN_STEPS = 50, 20  # the data-wait warning's rolling window of steps


class ThroughputOptions(Options):
    peak_tflops: float | None = Field(None, gt=0, help="the device's peak TFLOP/s for MFU, instead of the GPU "
                                                       "table or the CPU benchmark")
    low_mfu: float = Field(0.0, ge=0, le=1, help="warn once when the median MFU of the logging windows falls "
                                                 "below this (0: off; small models are far below any sane "
                                                 "target, large ones on GPUs reach 0.3-0.5)")
    data_wait_warn: float = Field(0.4, gt=0, le=1, help="warn once when the median of the last 50 steps "
                                                        "spends more than this share waiting for its batch")


def gpu_peak(name: str, precision: str, tf32: bool = True) -> float | None:
    """The dense peak TFLOP/s of the GPU called ``name`` (``torch.cuda.get_device_name``) for a run in
    ``precision``: the 16-bit tensor-core peak for the 16-bit precisions, else TF32's when float32
    matmuls may use it (``tf32``), else plain FP32's. None for a GPU the table does not know. The
    longest table name contained in ``name`` wins ("H100 PCIe" over "H100", "A100" over "A10")."""
    upper = name.upper()
    matches = [key for key in GPU_PEAKS if key.upper() in upper]
    if not matches:
        return None
    sixteen, tf32_peak, fp32 = GPU_PEAKS[max(matches, key=len)]
    if precision in SIXTEEN_BIT:
        return sixteen
    return tf32_peak if tf32 and precision == "32-true" else fp32


def cache_dir() -> Path:
    return Path(os.environ["LMLAB_CACHE"]) if os.environ.get("LMLAB_CACHE") else Path.home() / ".cache" / "lmlab"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def measure_cpu_peak() -> float:
    """This CPU's peak float32 TFLOP/s on this process's threads: the best of :func:`matmul_tflops`
    over three sizes (BLAS reaches its peak at a size that depends on the cache)."""
    return max(matmul_tflops(0.5, n) for n in (512, 1024, 2048))


def matmul_tflops(seconds: float = 1.0, n: int = 1024) -> float:
    """TFLOP/s of float32 ``n × n`` matmuls on this process's threads: the best of repeated
    batches over about ``seconds`` (the best, since other work only ever slows a batch down)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm up: thread pool, caches
    flops, best = 2.0 * n ** 3, 0.0
    end = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b, out=out)
        now = time.perf_counter()
        best = max(best, 4 * flops / max(now - start, 1e-9))
        if now >= end:
            return best / 1e12


#: Load average per core above which a CPU peak measurement is taken again later.
BUSY = 0.3


def _load() -> float:
    """The 1-minute load average per core (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def cpu_peak() -> float:
    """The CPU's measured peak TFLOP/s for this thread count, from the cache or measured now."""
    path = cache_dir() / "throughput" / "cpu-peak.json"
    key = f"{cpu_model()} | {torch.get_num_threads()} threads"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    entry = cached.get(key)
    load = _load()
    known = float(entry["tflops"]) if isinstance(entry, dict) and isinstance(entry.get("tflops"), (int, float)) \
        and entry["tflops"] > 0 else None
    # Other work on the machine only ever lowers a measurement: one taken under load is taken again
    # when the machine is quieter, and the best one is kept.
    if known is not None and not (entry.get("load", 0.0) > BUSY and load < entry.get("load", 0.0) - 0.5):
        return known
    tflops = measure_cpu_peak()
    if known is not None and known >= tflops:
        return known
    cached[key] = {"tflops": tflops, "benchmark": "float32 matmul, best of 512/1024/2048", "load": load}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)  # atomic: processes measuring at once leave one whole file
    except OSError:
        pass  # an unwritable cache costs a benchmark next time, nothing else
    return tflops


def matmul_params(model: torch.nn.Module) -> int:
    """``N``: the parameters that multiply activations, every one but the token and position
    embeddings, with a head tied to the token embedding counted (it multiplies)."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    head = getattr(getattr(inner, "head", None), "weight", None)
    total = 0
    for name, p in inner.named_parameters():
        lookup = name.split(".", 1)[0] in ("tok_emb", "position")
        if lookup and p is not head:
            continue
        total += p.numel()  # a DTensor's numel is the whole tensor's, as wanted
    return total


def flops_per_token(n_params: int, n_layers: int, d_model: int, block_size: int) -> float:
    """Training FLOPs of one token (forward and backward), PaLM's estimate."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * block_size


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Throughput(Monitor):
    """``throughput``: logs MFU, achieved TFLOP/s and the data-wait share of each logging window."""

    Options = ThroughputOptions
    api = ">=1.20,<2"  # RunControl.run; lmlab.api.monitor (1.7)

    def __init__(self, options=None):
        super().__init__(options)
        self.peak: float | None = self.options.peak_tflops
        self.peak_source: str | None = "option" if self.peak is not None else None
        self.flops_per_token: float | None = None
        self._cpu_peak: float | None = None
        self._step_s = 0.0
        self._tokens = 0
        self._waits: list[float] = []  # each step's data-wait share in this window
        self._recent: deque[float] = deque(maxlen=WAIT_SPAN)  # the same, over the last steps (not the first window)
        self._windows = 0
        self.mfus: list[float] = []
        self.data_waits: list[float] = []
        self._warned_wait = self._warned_mfu = self._warned_peak = False

    @hookimpl
    def lmlab_run_start(self, control):
        if self.peak is not None:
            return
        try:
            parallel = control.run.options("parallel")
            kind = resolve_devices(getattr(parallel, "accelerator", "auto"), 1)[0]
        except Exception:  # noqa: BLE001 - the device is known for sure at the first step
            return
        if kind == "cpu":
            self._cpu_peak = cpu_peak()  # here, before the first step's clock starts

    def _resolve(self, model, device: torch.device, control) -> None:
        shape = control.run.model
        self.flops_per_token = flops_per_token(matmul_params(model), shape.n_layers, shape.d_model, shape.block_size)
        if self.peak is not None:
            return
        precision = control.run.train.precision
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
            self.peak, self.peak_source = gpu_peak(name, precision, tf32), "table"
            if self.peak is None:
                self.peak_source = None
                control.note(f"throughput: no peak FLOP/s known for {name}; set monitor.throughput.peak_tflops "
                             "to get MFU")
        elif device.type == "cpu":
            # Measured in lmlab_run_start unless the device was not foreseen; then now, once.
            self.peak = self._cpu_peak if self._cpu_peak is not None else cpu_peak()
            self.peak_source = "measured"
        elif not self._warned_peak:
            self._warned_peak = True
            control.note(f"throughput: no peak FLOP/s known for a {device.type} device; set "
                         "monitor.throughput.peak_tflops to get MFU")

    @hookimpl
    def lmlab_train_batch_end(self, step, loss, model, log, timing, control):
        if timing is None:
            return None
        if self.flops_per_token is None:
            self._resolve(model, loss.device if loss is not None else torch.device("cpu"), control)
        self._step_s += timing.step_s
        self._tokens += timing.tokens
        if timing.step_s > 0:
            self._waits.append(min(timing.data_wait_s / timing.step_s, 1.0))
        if not log:
            return None
        return self._close_window(step, control)

    def _close_window(self, step: int, control) -> dict:
        metrics = {}
        first = self._windows == 0
        self._windows += 1
        if self._waits:
            wait = statistics.fmean(self._waits)
            metrics["data_wait"] = wait
            self.data_waits.append(wait)
            if not first:
                self._recent.extend(self._waits)
            typical = statistics.median(self._recent) if len(self._recent) >= WAIT_MIN_STEPS else 0.0
            if not self._warned_wait and typical > self.options.data_wait_warn:
                self._warned_wait = True
                control.note(f"step {step}: the step waits for its batch {typical:.0%} of the time: an I/O or CPU "
                             f"bottleneck (below {1 - typical:.0%} utilisation); more data-loading workers, "
                             "prepared (pre-tokenised) data or a faster disk would help")
        if self._step_s > 0 and self.flops_per_token:
            achieved = self.flops_per_token * self._tokens / self._step_s / world_size()  # FLOP/s per device
            metrics["achieved_tflops"] = achieved / 1e12
            if self.peak:
                metrics["mfu"] = achieved / (self.peak * 1e12)
                self.mfus.append(metrics["mfu"])
                self._check_mfu(step, control)
        self._step_s, self._tokens, self._waits = 0.0, 0, []
        return metrics

    def _check_mfu(self, step: int, control) -> None:
        low = self.options.low_mfu
        if not low or self._warned_mfu or len(self.mfus) < 4:
            return
        median = statistics.median(self.mfus[1:])
        if median < low:
            self._warned_mfu = True
            control.note(f"step {step}: MFU is {median:.1%} (< {low:.0%}) of a {self.peak:g} TFLOP/s peak: the "
                         "device mostly idles; a larger batch_size, bf16 precision, compile = true or a larger "
                         "model would use it better")

    @hookimpl
    def lmlab_run_end(self):
        summary = {"peak_tflops": self.peak, "peak_source": self.peak_source}
        if self.mfus:
            summary["mfu_median"] = statistics.median(_settled(self.mfus))
        if self.data_waits:
            summary["data_wait_median"] = statistics.median(_settled(self.data_waits))
        return summary


def _settled(windows: list[float]) -> list[float]:
    """The logging windows after the first, which holds start-up and compilation (all of them when
    there is only one)."""
    return windows[1:] if len(windows) > 1 else windows
