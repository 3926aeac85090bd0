"""The host optimizer step of ZeRO-Offload: DeepSpeed's CPU Adam against torch's AdamW, on this CPU.

Part 1, the step alone: fp32 parameters and gradients of about 100 M elements (a GPT-2-small-sized
model's worth, in 12 tensors of 8.4 M), one AdamW step each way, all threads of this process:
DeepSpeed's ``DeepSpeedCPUAdam`` (AdamW mode; the C++ op built on first use), torch's AdamW with
``foreach=True`` and with ``fused=True``, and the single-tensor loop (``foreach=False``) as the
baseline. Each is timed over ``--steps`` steps after two warm-up steps, alternating, best step taken;
the script checks that the four give the same parameters after the steps (to 1e-5).

Part 2, whole training steps: ``lmlab run`` with ZeRO-2 and ``offload_optimizer = "cpu"`` on 2
processes (one thread each) for a small model (6 layers, d_model 384, 11 M parameters), once with
``cpu_adam = "deepspeed"`` and once with ``"torch"``; the median step time of the steady steps
(from each run's tokens/s). Run alone: nothing else on the machine.

    python bench/offload_adam.py [--steps 5] [--no-runs]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

N_TENSORS, TENSOR = 12, 8_388_608  # 100.7 M elements


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(TENSOR, generator=g) for _ in range(N_TENSORS)]
    grads = [torch.randn(TENSOR, generator=g) * 1e-2 for _ in range(N_TENSORS)]
    return params, grads


def _optimizer(kind: str, params):
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if kind == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **hyper)
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}[kind]
    return torch.optim.AdamW(params, **hyper, **flags)


def step_times(steps: int) -> dict[str, float]:
    kinds = ("loop", "foreach", "fused", "deepspeed")
    runs, finals = {}, {}
    for kind in kinds:
        params, grads = _state()
        params = [torch.nn.Parameter(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        runs[kind] = (_optimizer(kind, params), params)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(steps + 2):
        for kind in kinds:
            optimizer, _ = runs[kind]
            start = time.perf_counter()
            optimizer.step()
            if i >= 2:
                times[kind].append(time.perf_counter() - start)
    for kind in kinds:
        finals[kind] = torch.cat([p.detach().reshape(-1) for p in runs[kind][1]])
    worst = max((finals[k] - finals["loop"]).abs().max().item() for k in kinds)
    print(f"  parameters agree after {steps + 2} steps: largest difference from the loop {worst:.2e}")
    assert worst <= 1e-5, worst
    return {k: min(t) for k, t in times.items()}


MANIFEST = """name = "offload-adam"
seed = 1
[data]
use = "text-file"
path = "{data}"
[tokenizer]
use = "char"
[model]
n_layers = 6
d_model = 384
n_heads = 6
block_size = 256
[train]
max_steps = {steps}
batch_size = 4
warmup_steps = 2
eval_every = 1000
eval_steps = 1
log_every = 1
checkpoint_every = 1000
sample_tokens = 0
[tracker]
use = "none"
[parallel]
use = "deepspeed"
devices = 2
accelerator = "cpu"
stage = 2
offload_optimizer = "cpu"
cpu_adam = "{choice}"
"""


def run_step_time(choice: str, folder: Path, steps: int = 12) -> float:
    data = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"
    if not data.is_file():
        data = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
    path = folder / f"{choice}.toml"
    path.write_text(MANIFEST.format(data=data, steps=steps, choice=choice))
    out = folder / choice
    result = subprocess.run([sys.executable, "-m", "lmlab", "run", str(path), "--out", str(out)], capture_output=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    records = [json.loads(x) for x in (out / "default" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][3:]  # after the first steps
    tokens = 2 * 4 * 256  # two ranks of 4 sequences of 256 tokens per step
    return tokens / statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-runs", action="store_true", help="part 1 only")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} | torch threads: {torch.get_num_threads()}")
    print(f"part 1: one AdamW step over {N_TENSORS * TENSOR / 1e6:.1f} M fp32 parameters")
    best = step_times(args.steps)
    for kind, seconds in best.items():
        print(f"  {kind:9s} {seconds * 1e3:8.1f} ms  ({best['loop'] / seconds:.2f}x the single-tensor loop, "
              f"{best['foreach'] / seconds:.2f}x foreach)")
    if not args.no_runs:
        print("part 2: a ZeRO-2-offload training step, 2 processes of one thread, 11 M parameters")
        with tempfile.TemporaryDirectory() as tmp:
            times = {choice: run_step_time(choice, Path(tmp)) for choice in ("deepspeed", "torch")}
        for choice, seconds in times.items():
            print(f"  cpu_adam = {choice!r:12s} {seconds * 1e3:8.1f} ms per step")
        print(f"  ratio torch / deepspeed = {times['torch'] / times['deepspeed']:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
