"""``lmlab generate RUN_DIR --prompt TEXT``: text from a trained run's best (or last) checkpoint."""

from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a variant's run folder (holds manifest.toml)")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling decoders")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's manifest, e.g. --set decoding.use=sample")


def main(args) -> int:
    from lmlab.sampling import generate_text
    from lmlab.trained import load_run, refuse_bidirectional

    if args.max_new_tokens < 1:
        raise UserError("must be positive", key="--max-new-tokens")
    run = load_run(args.run_dir, args.overrides)
    refuse_bidirectional(run.objective)
    print(args.prompt + generate_text(run.model, run.tokenizer, run.plugins["decoding"], args.prompt,
                                      args.max_new_tokens, seed=args.seed))
    return 0
