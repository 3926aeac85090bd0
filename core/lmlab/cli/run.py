"""``lmlab run MANIFEST``: trains every variant into ``runs/<name>/<variant>/``."""

import json
import os
import sys
from pathlib import Path

from lmlab import manifest
from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("manifest", help="path to a TOML manifest")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a manifest value (repeatable), e.g. --set train.max_steps=100")
    parser.add_argument("--out", type=Path, help="runs folder (default: runs/<name>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue interrupted variants from their last checkpoint; skip completed ones")


def main(args) -> int:
    variants = manifest.load(args.manifest, args.overrides)
    out = args.out or Path("runs") / variants[0].manifest["name"]
    main_process = _is_main_process()
    say = (lambda text: print(text, file=sys.stderr)) if main_process else (lambda text: None)
    plan = []
    for variant in variants:
        run_dir = out / variant.name
        status = _status(run_dir)
        if status == "completed" and args.resume:
            say(f"[{variant.name}] already completed; skipped")
            continue
        # Other ranks of a distributed run re-run this command after the main one has checked the
        # folder and started writing there: only the main process refuses to overwrite.
        if status is not None and not args.resume and main_process:
            raise UserError(f"{run_dir} already holds a run ({status}); pass --resume to continue it, "
                            "or --out to write elsewhere", key=str(run_dir))
        plan.append((variant, run_dir))
    for note in {n for v, _ in plan for n in v.notes}:
        say(f"note: {note}")

    from lmlab.sampling import generate_text
    from lmlab.train.runner import run_variant

    failed = 0
    for i, (variant, run_dir) in enumerate(plan, 1):
        say(f"[{i}/{len(plan)}] {variant.name} → {run_dir}")
        result = run_variant(variant, run_dir, resume=args.resume)
        s = result.summary
        if not result.is_main:
            continue
        if s["status"] != "completed":
            failed += 1
            continue
        print(f"[{variant.name}] val_loss {s['val_loss']:.4f} (ppl {s['val_ppl']:.2f}) | "
              f"{s['tokens_per_s'] or 0:,.0f} tokens/s | {s['wall_s']:.0f}s | {s['params']:,} params")
        cfg = variant.manifest["train"]
        if cfg["sample_tokens"]:
            text = generate_text(result.module.model, result.tokens.tokenizer, result.plugins["decoding"],
                                 cfg["sample_prompt"], cfg["sample_tokens"], seed=variant.manifest["seed"])
            print(f"--- sample ({variant.manifest['decoding']['use']}) ---\n{cfg['sample_prompt']}{text}\n---")
    return 1 if failed else 0


def _is_main_process() -> bool:
    """False in the worker processes of a distributed launch (Lightning, torchrun, SLURM)."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def _status(run_dir: Path) -> str | None:
    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            return json.loads(summary.read_text()).get("status", "unknown")
        except json.JSONDecodeError:
            return "unknown"
    if (run_dir / "checkpoints" / "last.ckpt").is_file() or (run_dir / "metrics.jsonl").is_file():
        return "interrupted"
    return None
