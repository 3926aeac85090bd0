"""Training throughput: lmlab (the Lightning path) against a hand-written PyTorch loop, same run.

Both train nanoGPT's baby GPT (experiments/shakespeare-char.toml) on the same tokens. They are
interleaved finely: every K lmlab steps, a hook pauses lmlab and runs K steps of the plain loop, so
machine noise (frequency scaling, neighbours) hits both alike. The first steps of each are left
out (warm-up). Printed: the median time per step of each and the ratio of tokens/s, lmlab / plain
(target ≥ 0.95).

    python bench/train_speed.py [--steps 1000] [--every 20] [--warmup 100]
"""

import argparse
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
from lmlab.api import hookimpl  # noqa: E402
from lmlab.assemble import assemble  # noqa: E402
from lmlab.train.runner import run_variant  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class PlainLoop:
    """nanoGPT's train.py inner loop: get_batch, forward, backward, clip, AdamW, cosine LR, a loss
    sync every 10 steps (its log interval)."""

    def __init__(self, train: np.ndarray, vocab: int, cfg: dict, max_steps: int, model=None):
        m, t = cfg["model"], cfg["train"]
        torch.manual_seed(0)
        self.model = model or GPT(vocab, m["block_size"], m["n_layers"], m["d_model"], m["n_heads"])
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99))
        self.data = torch.from_numpy(train.astype(np.int64))
        self.B, self.T, self.max_steps, self.it = t["batch_size"], m["block_size"], max_steps, 0

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.it += 1
            progress = min(self.it / self.max_steps, 1.0)
            lr = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + np.cos(np.pi * progress))
            for group in self.opt.param_groups:
                group["lr"] = lr
            ix = torch.randint(len(self.data) - self.T - 1, (self.B,))
            x = torch.stack([self.data[i:i + self.T] for i in ix])
            y = torch.stack([self.data[i + 1:i + 1 + self.T] for i in ix])
            logits = self.model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.it % 10 == 0:
                loss.item()


class Interleave:
    """A hook that times lmlab's steps between pauses, and the plain loop's steps in the pauses."""

    def __init__(self, plain: PlainLoop, every: int, warmup: int):
        self.plain, self.every, self.warmup = plain, every, warmup
        self.lmlab_s: list[float] = []
        self.plain_s: list[float] = []
        self.mark = None

    @hookimpl
    def lmlab_train_batch_end(self, step):
        if step < self.warmup or step % self.every:
            return None
        now = time.perf_counter()
        if self.mark is not None:
            self.lmlab_s.append((now - self.mark) / self.every)
        else:
            self.plain.steps(self.warmup)  # warm the plain loop up too
        start = time.perf_counter()
        self.plain.steps(self.every)
        self.plain_s.append((time.perf_counter() - start) / self.every)
        self.mark = time.perf_counter()
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--same-model", action="store_true",
                        help="run the plain loop on lmlab's own model: isolates the training path's overhead")
    args = parser.parse_args()
    # Evaluation and checkpoints only at the end: this measures the training step.
    overrides = ["tracker.use=none", "train.sample_tokens=0", f"train.max_steps={args.steps}",
                 f"train.eval_every={args.steps}", "train.eval_steps=1", f"train.checkpoint_every={args.steps}"]
    (variant,) = manifest.load(ROOT / "experiments" / "shakespeare-char.toml", overrides)
    built = assemble(variant, data=True)
    data = built.tokens
    model = built.model if args.same_model else None
    plain = PlainLoop(data.train, data.tokenizer.vocab_size, variant.manifest, args.steps, model)
    probe = Interleave(plain, args.every, args.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        run_variant(variant, Path(tmp) / "run", extra_hooks=[probe])
    tokens = variant.manifest["train"]["batch_size"] * variant.manifest["model"]["block_size"]
    lm, pl = statistics.median(probe.lmlab_s), statistics.median(probe.plain_s)
    print(f"threads {torch.get_num_threads()} | {len(probe.lmlab_s)} interleaved windows of {args.every} steps")
    print(f"plain loop  {pl * 1e3:6.2f} ms/step  {tokens / pl:9,.0f} tokens/s")
    print(f"lmlab       {lm * 1e3:6.2f} ms/step  {tokens / lm:9,.0f} tokens/s")
    print(f"ratio lmlab / plain tokens/s = {pl / lm:.3f}  (target >= 0.95)")


if __name__ == "__main__":
    main()
