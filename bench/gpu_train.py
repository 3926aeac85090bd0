"""Training throughput and MFU on CUDA GPUs: the quickstart manifest with bf16-mixed, under single-device,
FSDP and DeepSpeed ZeRO-2, each an ordinary ``lmlab run`` of the same manifest with --set overrides.

Prints, per strategy: tokens/s (median over the run's logging windows, as summary.json reports it) and
model FLOPs utilisation, MFU = achieved model FLOPs / the GPUs' peak bf16 FLOPs. Model FLOPs per token
follow Chinchilla's accounting (Hoffmann et al. 2022, appendix F) as PaLM's MFU does: 6 N for the weights
(forward 2N, backward 4N) plus 12 · n_layers · d_model · block_size for attention scores and values;
recomputation is not counted (that is what makes it MFU rather than HFU).

    python bench/gpu_train.py                       # the quickstart shape (tiny: MFU will be low)
    python bench/gpu_train.py --size gpt2-small     # 124M parameters, block 1024: a meaningful MFU
    python bench/gpu_train.py --devices 8 --peak-tflops 989

Needs a CUDA GPU (and deepspeed installed for the ZeRO-2 row); prints what it skipped and why.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "experiments" / "shakespeare-char.toml"

#: Dense bf16 peak per GPU in TFLOP/s (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0,
               "RTX 4090": 165.0, "V100": 125.0}

SIZES = {
    "quickstart": [],
    "gpt2-small": ["model.n_layers=12", "model.d_model=768", "model.n_heads=12", "model.block_size=1024",
                   "train.batch_size=16", "train.eval_every=100", "train.eval_steps=5"],
}

STRATEGIES = {
    "single": ["parallel.use=single"],
    "fsdp": ["parallel.use=fsdp", "parallel.accelerator=cuda"],
    "deepspeed-zero2": ["parallel.use=deepspeed", "parallel.stage=2", "parallel.accelerator=cuda"],
}


def model_flops_per_token(params: int, n_layers: int, d_model: int, block_size: int) -> float:
    return 6.0 * params + 12.0 * n_layers * d_model * block_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="quickstart")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices", type=int, default=None, help="GPUs for fsdp/deepspeed (default: all)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-GPU bf16 peak (default: by name)")
    parser.add_argument("--only", action="append", choices=STRATEGIES, help="strategies to run (default: all)")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: this benchmark measures GPU throughput (nothing was run)")
    name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    devices = args.devices or torch.cuda.device_count()
    print(f"{name} x{torch.cuda.device_count()} | peak bf16 {peak or '?'} TFLOP/s per GPU | size {args.size}")
    print(f"{'strategy':16s} {'GPUs':>4s} {'tokens/s':>12s} {'MFU':>7s}  val_loss")
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.only or list(STRATEGIES):
            gpus = 1 if strategy == "single" else devices
            overrides = [*SIZES[args.size], f"train.max_steps={args.steps}", "train.precision=bf16-mixed",
                         "train.sample_tokens=0", "tracker.use=none", *STRATEGIES[strategy]]
            if strategy != "single":
                overrides.append(f"parallel.devices={gpus}")
            command = [sys.executable, "-m", "lmlab", "run", str(MANIFEST), "--out", f"{tmp}/{strategy}",
                       *(f"--set={o}" for o in overrides)]
            result = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            summary_path = Path(tmp) / strategy / "default" / "summary.json"
            if result.returncode != 0 or not summary_path.exists():
                print(f"{strategy:16s} {gpus:4d}  failed: {result.stderr.strip().splitlines()[-1:]}")
                continue
            s = json.loads(summary_path.read_text())
            model = tomllib.loads((Path(tmp) / strategy / "default" / "manifest.toml").read_text())["model"]
            flops = model_flops_per_token(s["params"], model["n_layers"], model["d_model"], model["block_size"])
            mfu = s["tokens_per_s"] * flops / (gpus * peak * 1e12) if peak else None
            print(f"{strategy:16s} {gpus:4d} {s['tokens_per_s']:12,.0f} "
                  f"{f'{mfu:.1%}' if mfu is not None else '?':>7s}  {s['val_loss']:.4f}")


if __name__ == "__main__":
    main()
