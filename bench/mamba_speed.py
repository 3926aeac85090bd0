"""Training throughput of the ``mamba`` mixer against softmax attention, same run.

Two models of the quickstart shape (experiments/shakespeare-char.toml: 4 layers, d_model 128, block 64,
batch 12), built by lmlab's own model builder from the manifest: ``mha`` with learned positions, and
``mamba`` with position ``none`` (same mlp feed-forward, norms and head). Each trains with AdamW on the
same batches (forward, backward, clip, step); they alternate in windows of ``--every`` steps so machine
noise hits both alike, and the first window of each is left out (warm-up). Printed: the median time per
step of each, tokens/s, and the ratio mamba / mha (target ≥ 0.5 on a 2-core CPU).

    python bench/mamba_speed.py [--windows 10] [--every 10] [--threads 1] [--set attention.chunk_size=8 ...]
"""

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from lmlab import manifest
from lmlab.train import build
from lmlab.train import tokens as token_cache

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"mha": ["attention.use=mha", "position.use=learned"],
            "mamba": ["attention.use=mamba", "position.use=none"]}


class Trainer:
    """One model and its AdamW, trained by the plain loop of bench/train_speed.py."""

    def __init__(self, overrides: list[str]):
        (variant,) = manifest.load(ROOT / "experiments" / "shakespeare-char.toml", ["tracker.use=none", *overrides])
        data = token_cache.prepare(variant)
        plugins = build.instantiate_all(variant)
        torch.manual_seed(0)
        self.model = build.build_model(variant, build.model_shape(variant, data.tokenizer.vocab_size), plugins)
        infos = self.model.param_infos()
        self.opt = torch.optim.AdamW([{"params": [i.param for i in infos if i.decay], "weight_decay": 0.1},
                                      {"params": [i.param for i in infos if not i.decay], "weight_decay": 0.0}],
                                     lr=1e-3, betas=(0.9, 0.99))
        self.data = torch.from_numpy(data.train.astype(np.int64))
        self.B, self.T = variant.manifest["train"]["batch_size"], variant.manifest["model"]["block_size"]
        self.params = self.model.num_params()

    def steps(self, n: int, gen: torch.Generator) -> float:
        """Seconds per step over n steps."""
        start = time.perf_counter()
        for _ in range(n):
            ix = torch.randint(len(self.data) - self.T - 1, (self.B,), generator=gen)
            x = torch.stack([self.data[i:i + self.T] for i in ix])
            y = torch.stack([self.data[i + 1:i + 1 + self.T] for i in ix])
            logits = self.model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        loss.item()
        return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=10, help="timed windows per model (after one warm-up)")
    parser.add_argument("--every", type=int, default=10, help="steps per window")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="extra override for the mamba model, e.g. attention.chunk_size=4")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trainers = {"mha": Trainer(VARIANTS["mha"]), "mamba": Trainer(VARIANTS["mamba"] + args.overrides)}
    times = {name: [] for name in trainers}
    gens = {name: torch.Generator().manual_seed(1) for name in trainers}
    for window in range(args.windows + 1):
        for name, trainer in trainers.items():
            seconds = trainer.steps(args.every, gens[name])
            if window:  # the first window warms allocators and caches
                times[name].append(seconds)
    tokens = trainers["mha"].B * trainers["mha"].T
    print(f"threads {torch.get_num_threads()} | {args.windows} interleaved windows of {args.every} steps | "
          f"batch {trainers['mha'].B} x block {trainers['mha'].T}")
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in median.items():
        print(f"{name:6s} {trainers[name].params:9,d} params  {seconds * 1e3:7.2f} ms/step  "
              f"{tokens / seconds:9,.0f} tokens/s")
    print(f"ratio mamba / mha tokens/s = {median['mha'] / median['mamba']:.3f}  (target >= 0.5)")


if __name__ == "__main__":
    main()
