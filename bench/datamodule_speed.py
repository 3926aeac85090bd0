"""How much faster the DataModule delivers training batches than the baby GPT consumes them.

The consumer is the quickstart model (nanoGPT's baby GPT: 4 layers, d_model 128, batch 12 × 64)
stepping on this CPU (forward, backward, clip, AdamW; ``bench/stepper.py``). The producer is lmlab's
``TokenDataModule.train_dataloader()`` as training uses it (random windows gathered from the
memory-mapped tokens, through a DataLoader), on tinyshakespeare (one shard) and on the Python standard
library prepared into many shards (windows then may cross shard boundaries). Prints the ratio of the
two rates.

    python bench/datamodule_speed.py [--batches 3000] [--steps 30]
"""

import argparse
import os
import sysconfig
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from stepper import QUICKSTART, ModelStepper

from lmlab import manifest
from lmlab.prepare import tokens as token_cache
from lmlab.train.data_module import TokenDataModule

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def seconds_per_batch(data, block_size: int, batch_size: int, n: int) -> float:
    module = TokenDataModule(data, block_size, batch_size, 4 * batch_size, 20, seed=1337, grad_accum=1)
    module.trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace())  # what train_dataloader reads
    batches = iter(module.train_dataloader())
    next(batches)
    start = time.perf_counter()
    for _ in range(n):
        next(batches)
    return (time.perf_counter() - start) / n


def stdlib_shards(scratch: Path):
    path = scratch / "stdlib.toml"
    path.write_text(f'name = "stdlib"\n\n[data]\nuse = "text-file"\npath = "{STDLIB}/**/*.py"\n'
                    'exclude = ["*/site-packages/*"]\nbad_file = "skip"\n\n[tokenizer]\nuse = "byte"\n\n'
                    '[tracker]\nuse = "none"\n')
    (variant,) = manifest.load(path)
    from lmlab.prepare import pipeline

    folder = pipeline.prepare_corpus(variant, root=scratch / "cache", shard_mb=1.0, listener=lambda e, i: None)
    return token_cache.open_prepared(variant, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    (variant,) = manifest.load(QUICKSTART, ["tracker.use=none"])
    B, T = variant.manifest["train"]["batch_size"], variant.manifest["model"]["block_size"]
    stepper = ModelStepper([])
    stepper.steps(3)  # warm-up
    step = stepper.steps(args.steps)
    print(f"baby GPT training step  {step * 1e3:8.2f} ms  ({1 / step:8.1f} batches/s consumed)")
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {"tinyshakespeare, 1 shard": token_cache.load_tokens(variant),
                   "stdlib, many shards": stdlib_shards(Path(tmp))}
        for name, data in corpora.items():
            shards = len(data.index["shards"]["train"])
            per_batch = seconds_per_batch(data, T, B, args.batches)
            print(f"DataModule ({name}: {shards} train shard(s), {len(data.train):,} tokens)  "
                  f"{per_batch * 1e6:8.1f} µs/batch ({1 / per_batch:9.0f} batches/s)  "
                  f"→ {step / per_batch:6.0f}× faster than consumed (target >= 50)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
