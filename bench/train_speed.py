"""Training throughput: lmlab (Lightning path) against a hand-written PyTorch loop, same run.

Both train nanoGPT's baby GPT (experiments/shakespeare-char.toml) on the same tokens for the same
number of steps, interleaved round by round so machine noise hits both alike. Each round's
throughput is the median over log windows after the first (start-up excluded); the ratio printed
is median(lmlab rounds) / median(plain rounds). Target: ≥ 0.95.

    python bench/train_speed.py [--rounds 3] [--steps 300]
"""

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from handwritten_gpt import GPT  # noqa: E402

from lmlab import manifest  # noqa: E402
from lmlab.train import tokens as token_cache  # noqa: E402
from lmlab.train.runner import run_variant  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOG_EVERY = 10


def plain_loop(train: np.ndarray, vocab: int, cfg: dict, steps: int, seed: int) -> float:
    """nanoGPT's train.py inner loop: get_batch, forward, backward, clip, AdamW, cosine LR."""
    torch.manual_seed(seed)
    m = cfg["model"]
    model = GPT(vocab, m["block_size"], m["n_layers"], m["d_model"], m["n_heads"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))
    data = torch.from_numpy(train.astype(np.int64))
    B, T = cfg["train"]["batch_size"], m["block_size"]
    rates, window = [], time.perf_counter()
    for it in range(1, steps + 1):
        lr = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * min(it / steps, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([data[i:i + T] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + T] for i in ix])
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if it % LOG_EVERY == 0:
            loss.item()
            now = time.perf_counter()
            rates.append(LOG_EVERY * B * T / (now - window))
            window = now
    return statistics.median(rates[1:])


def lmlab_run(variant, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        result = run_variant(variant, Path(tmp) / "run")
    return result.summary["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    overrides = [f"train.max_steps={args.steps}", f"train.log_every={LOG_EVERY}", "tracker.use=none",
                 "train.sample_tokens=0", f"train.eval_every={args.steps}", "train.eval_steps=1",
                 f"train.checkpoint_every={args.steps}"]
    (variant,) = manifest.load(ROOT / "experiments" / "shakespeare-char.toml", overrides)
    data = token_cache.prepare(variant)
    cfg = variant.manifest
    plain, framework = [], []
    for r in range(args.rounds):
        plain.append(plain_loop(data.train, data.tokenizer.vocab_size, cfg, args.steps, seed=r))
        framework.append(lmlab_run(variant, args.steps))
        print(f"round {r + 1}: plain {plain[-1]:,.0f} tok/s | lmlab {framework[-1]:,.0f} tok/s", flush=True)
    ratio = statistics.median(framework) / statistics.median(plain)
    print(f"threads {torch.get_num_threads()} | steps/round {args.steps} | rounds {args.rounds}")
    print(f"plain loop  median {statistics.median(plain):,.0f} tokens/s")
    print(f"lmlab       median {statistics.median(framework):,.0f} tokens/s")
    print(f"ratio lmlab / plain = {ratio:.3f}  (target >= 0.95)")


if __name__ == "__main__":
    main()
