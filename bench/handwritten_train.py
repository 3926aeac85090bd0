"""nanoGPT's training loop around ``handwritten_gpt.GPT``, with no lmlab code: the hand-written
script that the whole-process benchmarks start as a separate process.

The quickstart's configuration (experiments/shakespeare-char.toml: 4 layers, d_model 128, 4 heads,
block 64, batch 12, AdamW 1e-3, cosine to 1e-4, clip 1.0) on tinyshakespeare, characters as tokens.
Prints ``step N SECONDS`` after each optimizer step (flushed: a parent process timestamps the lines;
SECONDS is the training time so far, as lmlab's ``elapsed_s``) and ``done`` before it exits.

    python bench/handwritten_train.py --steps 400 [--data PATH]
"""

import argparse
import time
import sys
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from handwritten_gpt import GPT  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "block_size": 64}, "train": {"batch_size": 12}}


class PlainLoop:
    """nanoGPT's train.py inner loop: get_batch, forward, backward, clip, AdamW, cosine LR, a loss
    sync every 10 steps (its log interval)."""

    def __init__(self, train: np.ndarray, vocab: int, cfg: dict, max_steps: int, model=None, report=None):
        m, t = cfg["model"], cfg["train"]
        torch.manual_seed(0)
        self.model = model or GPT(vocab, m["block_size"], m["n_layers"], m["d_model"], m["n_heads"])
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99))
        self.data = torch.from_numpy(train.astype(np.int64))
        self.B, self.T, self.max_steps, self.it = t["batch_size"], m["block_size"], max_steps, 0
        self.report = report

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
            if self.report is not None:
                self.report(self.it)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "tinyshakespeare.txt")
    args = parser.parse_args()
    text = args.data.read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.uint16)
    train = ids[:int(0.9 * len(ids))]
    start = time.perf_counter()
    loop = PlainLoop(train, len(chars), CONFIG, args.steps,
                     report=lambda step: print(f"step {step} {time.perf_counter() - start:.5f}", flush=True))
    loop.steps(args.steps)
    print("done", flush=True)


if __name__ == "__main__":
    main()
