"""``lmlab compare RUNS_DIR``: one row per variant, seeds pooled, each tested against a baseline;
``--html`` and ``--png`` add the plots."""

from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("runs_dir", type=Path, nargs="?",
                        help="a manifest's runs folder, e.g. runs/attention-ablation (or use --wandb)")
    parser.add_argument("--metric", default="val_loss",
                        help="summary metric to compare (default val_loss; e.g. best_val_loss, tokens_per_s, or a "
                             "task score of lmlab eval --tasks as TASK/METRIC: shakespeare_next_line/acc)")
    parser.add_argument("--baseline", metavar="VARIANT",
                        help="variant (name without its seed) the others are tested against; default: the "
                             "sweep's first")
    parser.add_argument("--alpha", type=float, default=0.05, help="significance level of the test (default 0.05)")
    parser.add_argument("--html", type=Path, metavar="FILE", help="also write a self-contained HTML report")
    parser.add_argument("--png", type=Path, metavar="DIR", help="also write the plots as PNG images into DIR")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT/GROUP",
                        help="read the runs of this W&B group through the W&B API instead of a folder")


def main(args) -> int:
    from lmlab.report import runs as sources
    from lmlab.report.table import format_table, summarize

    if (args.runs_dir is None) == (args.wandb is None):
        raise UserError("give either a runs folder or --wandb ENTITY/PROJECT/GROUP", key="compare")
    if not 0 < args.alpha < 1:
        raise UserError("must be between 0 and 1", key="--alpha")
    runset = sources.from_wandb(args.wandb) if args.wandb else sources.from_folder(args.runs_dir)
    comparison = summarize(runset, args.metric, args.baseline, args.alpha)
    print(format_table(comparison))
    if args.html or args.png:
        from lmlab.report import plots
        from lmlab.rundir import atomic_write_bytes

        figures = plots.figures(comparison, runset)
        if args.png:
            args.png.mkdir(parents=True, exist_ok=True)
            for name, figure in figures.items():
                figure.savefig(args.png / f"{name}.png", dpi=110)
            print(f"plots: {', '.join(str(args.png / f'{name}.png') for name in figures)}")
        if args.html:
            from lmlab.report.html import render

            atomic_write_bytes(args.html, render(comparison, figures).encode())
            print(f"report: {args.html}")
    return 0
