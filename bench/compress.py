"""Every compress method on one trained run: validation perplexity, size and generation speed, one table.

Each row is one ``lmlab compress`` (``lmlab.compress.command.compress``) of RUN into a scratch folder:
the run is loaded, measured, compressed, written, loaded back from the new folder and measured again,
so every row's figures are on the same validation split (the whole of it), the same prompt set
(4 prompts of 16 tokens from that split, 128 new tokens each, batch 1, the run's decoder) and the
same calibration windows (128 of the model's length, seed 0, from the training split by default, so
that no calibrated search has seen the text its perplexity is measured on). Speed is
noisy on a shared CPU: each row's ``×speed`` is against the uncompressed model measured in the same
call, seconds before, which is the figure to read.

    python bench/compress.py RUN_DIR [--only NAME ...] [--calibration-split train|val] [--json FILE]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

#: (row label, --use methods, --set options), in the order of the table
ROWS = [
    ("int8 W8A8", ["int8"], []),
    ("nf4 (bitsandbytes)", ["nf4"], []),
    ("rtn int4 g32", ["rtn"], ["bits=4", "group_size=32"]),
    ("awq int4 g32", ["awq"], ["bits=4", "group_size=32"]),
    ("rtn int3 g32", ["rtn"], ["bits=3", "group_size=32"]),
    ("awq int3 g32", ["awq"], ["bits=3", "group_size=32"]),
    ("magnitude 50 % (per layer)", ["magnitude"], ["sparsity=0.5"]),
    ("wanda 50 % (per row)", ["wanda"], ["sparsity=0.5"]),
    ("magnitude 50 % (per row)", ["magnitude"], ["sparsity=0.5", "compare=\"row\""]),
    ("wanda 50 % (per layer)", ["wanda"], ["sparsity=0.5", "compare=\"layer\""]),
    ("magnitude 2:4", ["magnitude"], ["pattern=\"2:4\""]),
    ("wanda 2:4", ["wanda"], ["pattern=\"2:4\""]),
    *[(f"head-prune random (seed {seed}), 4 of 16 heads", ["head-prune"],
       ["heads=4", "importance=\"random\"", f"seed={seed}"]) for seed in range(3)],
    ("head-prune gradient, 4 of 16 heads", ["head-prune"], ["heads=4"]),
    ("head-prune gradient 4 + awq int4", ["head-prune", "awq"], ["head-prune.heads=4", "awq.bits=4"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--only", nargs="*", default=None, help="rows whose label contains any of these")
    parser.add_argument("--calibration-split", choices=("train", "val"), default="train")
    parser.add_argument("--json", type=Path, default=None, help="also write every row's summary here")
    args = parser.parse_args()

    from lmlab.compress.command import compress
    from lmlab.compress.methods import resolve

    rows = [r for r in ROWS if not args.only or any(o in r[0] for o in args.only)]
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, (label, uses, sets) in enumerate(rows):
            methods = resolve(uses, sets, Path.cwd())
            summary = compress(args.run_dir.resolve(), methods, Path(scratch) / str(i),
                               calibration_split=args.calibration_split, log=lambda *_: None)
            results.append((label, summary))
            print(f"done: {label}", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps({label: s for label, s in results}, indent=1))
    base = results[0][1]["base"]
    print("| method | val ppl | Δ ppl | disk bytes | × disk | memory bytes | tokens/s | × speed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| fp32 (the run) | {base['val_ppl']:.4f} | | {base['disk_bytes']:,} | 1 | {base['memory_bytes']:,} "
          f"| {base['tokens_per_s']:,.0f} | 1 |")
    for label, s in results:
        print(f"| {label} | {s['val_ppl']:.4f} | {s['val_ppl'] - s['base']['val_ppl']:+.4f} | {s['disk_bytes']:,} "
              f"| {s['disk_ratio']:.3f} | {s['memory_bytes']:,} | {s['tokens_per_s']:,.0f} | {s['speedup']:.2f} |")


if __name__ == "__main__":
    main()
