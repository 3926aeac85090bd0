"""``lmlab compress RUN_DIR --use METHOD [--use METHOD2] [--set NAME.KEY=VALUE]``: a smaller or faster copy
of a trained run as a new run folder, with its validation loss, sizes and generation speed beside the
original's; see :mod:`lmlab.compress`."""

import sys
from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a trained variant's run folder (holds manifest.toml)")
    parser.add_argument("--use", action="append", default=[], metavar="METHOD",
                        help="a compress method (lmlab plugins compress); repeat, or separate with commas, to chain "
                             "them in order: --use head-prune --use awq")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME.KEY=VALUE",
                        help="a method's option (KEY=VALUE when only one method is named)")
    parser.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                        help="text the calibrated methods measure activations on (default: the run's training split)")
    parser.add_argument("--calibration-split", choices=("train", "val"), default="train",
                        help="the run's split to calibrate on without --calibration (default train, so the reported "
                             "validation perplexity is on text the calibration never saw; val makes it optimistic)")
    parser.add_argument("--calibration-windows", type=int, default=128, metavar="N",
                        help="windows of the model's length to calibrate on (default 128)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the new run folder (default: beside RUN_DIR, named after it and the methods)")
    parser.add_argument("--device", default="cpu", help="where to compress and measure (default cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the calibration windows' choice")
    parser.add_argument("--timing-rounds", type=int, default=3, metavar="N",
                        help="interleaved rounds timing generation of both models; each reports its median (default 3)")


def main(args) -> int:
    from lmlab.compress.command import compress
    from lmlab.compress.methods import resolve

    if not (args.run_dir / "manifest.toml").is_file():
        raise UserError("is not a run folder (no manifest.toml)", key=str(args.run_dir))
    if args.calibration_windows < 1:
        raise UserError("must be positive", key="--calibration-windows")
    if args.timing_rounds < 1:
        raise UserError("must be positive", key="--timing-rounds")
    if args.calibration is not None and not args.calibration.is_file():
        raise UserError("no such file", key=str(args.calibration))
    methods = resolve(args.use, args.sets, Path.cwd())
    run_dir = args.run_dir.resolve()
    out = args.out or run_dir.with_name(f"{run_dir.name}+{'+'.join(m.label for m in methods)}")
    summary = compress(run_dir, methods, out.resolve(), calibration_file=args.calibration,
                       calibration_split=args.calibration_split,
                       windows=args.calibration_windows, seed=args.seed, device=args.device, rounds=args.timing_rounds,
                       log=lambda line: print(line, file=sys.stderr))
    base = summary["base"]
    print(f"{out}")
    print(f"  val ppl     {base['val_ppl']:.4f} -> {summary['val_ppl']:.4f}")
    print(f"  disk        {base['disk_bytes']:,} -> {summary['disk_bytes']:,} bytes (x{summary['disk_ratio']:.3f})")
    print(f"  memory      {base['memory_bytes']:,} -> {summary['memory_bytes']:,} bytes (x{summary['memory_ratio']:.3f})")
    print(f"  tokens/s    {base['tokens_per_s']:,.0f} -> {summary['tokens_per_s']:,.0f} (x{summary['speedup']:.2f})")
    return 0
