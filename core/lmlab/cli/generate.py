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
    from lmlab import manifest
    from lmlab.checkpoint import best_or_last, load_model_weights
    from lmlab.sampling import generate_text
    from lmlab.train import build

    manifest_path = args.run_dir / "manifest.toml"
    if not manifest_path.is_file():
        raise UserError("is not a run folder (no manifest.toml)", key=str(args.run_dir))
    if args.max_new_tokens < 1:
        raise UserError("must be positive", key="--max-new-tokens")
    (variant,) = manifest.load(manifest_path, args.overrides)
    tokenizer = variant.instantiate("tokenizer")
    tokenizer.load(args.run_dir / "tokenizer")
    plugins = {slot: variant.instantiate(slot) for slot in ("position", "attention", "ffn", "decoding")}
    shape = build.model_shape(variant, tokenizer.vocab_size)
    model = build.build_model(variant, shape, plugins)
    load_model_weights(model, best_or_last(args.run_dir))
    print(args.prompt + generate_text(model, tokenizer, plugins["decoding"], args.prompt,
                                      args.max_new_tokens, seed=args.seed))
    return 0
