"""``lmlab check MANIFEST``: validates and prints the resolved variants; trains nothing.

Imports only the plugins the manifest names (and never lightning, deepspeed, peft or wandb). Runs
every check a run makes before it trains (:mod:`lmlab.checks`), preparing the data only for a setting
that depends on the vocabulary a tokenizer learns from it.
"""

from lmlab import manifest
from lmlab.rundir import toml_text


def add_arguments(parser) -> None:
    parser.add_argument("manifest", help="path to a TOML manifest")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a manifest value (repeatable), e.g. --set train.max_steps=100")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="print nothing when every variant passes (for scripts: the exit status says it)")


def main(args) -> int:
    from lmlab import checks

    variants = manifest.load(args.manifest, args.overrides)
    checks.run_all(variants)  # what a run would refuse before training
    if args.quiet:
        return 0
    print(f"{args.manifest}: {len(variants)} variant{'s' if len(variants) != 1 else ''}")
    for variant in variants:
        print(f"\n# variant: {variant.name}")
        for note in variant.notes:
            print(f"# note: {note}")
        print(toml_text(variant.manifest), end="")
    return 0
