"""``lmlab merge RUN_DIR [--out DIR]``: fold a PEFT run's adapter into its base weights.

Loads the run as ``lmlab generate`` does (base weights, the peft plugin, the adapter of its best or
last checkpoint), asks the plugin to merge (``Peft.merge``), checks on a probe batch that the merged
model's logits are the adapted model's (refusing to write when they differ by more than 1e-4; float32
rounding leaves about 1e-6), and writes a run folder with a plain model: the manifest without its
``[peft]`` table, the tokenizer, ``checkpoints/last.ckpt`` holding the whole model, and ``merge.json``
(where it came from, the measured difference). ``lmlab generate`` and ``[init] from`` read it as any
other run.
"""

import sys
from pathlib import Path

from lmlab.errors import UserError

TOLERANCE = 1e-4


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a PEFT run's folder (its manifest has a [peft] table)")
    parser.add_argument("--out", type=Path, help="folder for the merged run (default: RUN_DIR-merged beside it)")
    parser.add_argument("--overwrite", action="store_true", help="replace what --out holds")


def main(args) -> int:
    import io
    import shutil
    import tomllib

    import torch

    from lmlab.rundir import atomic_write_bytes, write_json, write_toml
    from lmlab.trained import load_run

    run_dir = args.run_dir
    out = args.out or run_dir.with_name(run_dir.name + "-merged")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UserError("exists; pass --overwrite to replace it or --out to write elsewhere", key=str(out))
    run = load_run(run_dir)
    variant = run.variant
    if "peft" not in variant.slots:
        raise UserError("was trained without a [peft] table: there is no adapter to merge", key=str(run_dir))
    model, shape, step, plugin = run.model, run.shape, run.step, run.peft
    # The plain model's entry names, from a copy on the meta device: names only, no memory.
    with torch.device("meta"):
        plain_keys = set(run.build_model().state_dict())
    checkpoint = run.checkpoint
    if plugin is None:
        raise UserError(f"its peft plugin {variant.uses('peft')!r} added no adapter: the checkpoint "
                        "already holds the whole model", key=str(run_dir))

    model.eval()
    probe = torch.randint(0, shape.vocab_size, (2, min(shape.block_size, 64)),
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(probe)
        plugin.merge(model)
        merged = model(probe)
    if set(model.state_dict()) != plain_keys:
        left = sorted(set(model.state_dict()) ^ plain_keys)
        raise RuntimeError(f"peft plugin {plugin.name!r} merged into a model whose entries are not the plain "
                           f"model's: {left[:4]}")
    difference = (merged - adapted).abs().max().item()
    if not difference <= TOLERANCE:
        raise RuntimeError(f"the merged model's logits differ from the adapted model's by {difference:.2e} "
                           f"(more than {TOLERANCE:g}): peft plugin {plugin.name!r} merges wrongly")

    if out.exists() and args.overwrite:
        shutil.rmtree(out)
    with open(run_dir / "manifest.toml", "rb") as f:
        table = tomllib.load(f)
    table.pop("peft", None)
    write_toml(out / "manifest.toml", table)
    shutil.copytree(run_dir / "tokenizer", out / "tokenizer")
    record = {"from": str(run_dir.resolve()), "checkpoint": checkpoint.name, "step": step,
              "peft": variant.manifest["peft"], "max_abs_logit_difference": difference}
    buffer = io.BytesIO()
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()}, "global_step": step,
                "lmlab_merged": record}, buffer)
    atomic_write_bytes(out / "checkpoints" / "last.ckpt", buffer.getvalue())
    write_json(out / "merge.json", record)
    print(f"merged the {plugin.name} adapter of {run_dir} ({checkpoint.name}, step {step}) into {out}; "
          f"max |logit difference| on a probe batch: {difference:.1e}", file=sys.stderr)
    return 0
