"""``lmlab generate RUN_DIR``: text from a trained run, streamed to the terminal as it is made.

One ``--prompt`` streams its continuation; ``--prompts FILE`` (one prompt per line, or JSONL objects
with a ``"prompt"``) decodes them all as one batch and writes one JSON line per prompt as it
finishes. Either way the speed (new tokens per second) goes to stderr, with what the model's own
engine reports of how it decoded (``Engine.report``: early exit's average exit layer).
"""

import json
import sys
from pathlib import Path

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a variant's run folder (holds manifest.toml)")
    parser.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                        help="prompts to continue as one batch: one per line, or JSONL with a \"prompt\" field")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end a continuation at this text (not included); repeatable")
    parser.add_argument("--cache", choices=("contiguous", "paged"), default=None,
                        help="the key/value cache (default: the run's decoding.cache)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling decoders")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's manifest, e.g. --set decoding.use=beam --set decoding.width=4")


def read_prompts(path: Path) -> list[str]:
    """A prompts file: JSONL when its first non-empty line is a JSON object, else one prompt per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}", key="--prompts") from exc
    filled = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not filled:
        raise UserError(f"{path} holds no prompt", key="--prompts")
    if not filled[0][1].lstrip().startswith("{"):
        return [line for _, line in filled]
    prompts = []
    for n, line in filled:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not JSON ({exc.msg})", key="--prompts") from exc
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f"{path}:{n}: a JSON line needs a string \"prompt\"", key="--prompts")
        prompts.append(record["prompt"])
    return prompts


def main(args) -> int:
    if args.max_new_tokens < 1:
        raise UserError("must be positive", key="--max-new-tokens")
    if any(s == "" for s in args.stop):
        raise UserError("a stop string cannot be empty", key="--stop")
    if args.prompt is not None and args.prompts is not None:
        raise UserError("give --prompt or --prompts, not both", key="--prompts")
    prompts = read_prompts(args.prompts) if args.prompts is not None else [args.prompt if args.prompt is not None else "\n"]

    from lmlab.generation.batch import generate_texts
    from lmlab.generation.outputs import text_of
    from lmlab.generation.runs import prepare_decoder
    from lmlab.trained import load_run, refuse_bidirectional

    run = load_run(args.run_dir, args.overrides)
    refuse_bidirectional(run.objective)
    decoder = run.plugins["decoding"]
    prepare_decoder(decoder, run)
    cache = args.cache or getattr(decoder.options, "cache", "contiguous")
    block_size = getattr(decoder.options, "block_size", 16)
    show = None  # a batch is written as JSON lines at the end: no text to decode per step
    if args.prompts is None:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()

        def show(i, text):
            sys.stdout.write(text)
            sys.stdout.flush()

    result = generate_texts(run.model, run.tokenizer, decoder, prompts, args.max_new_tokens, stop=args.stop,
                            seed=args.seed, cache=cache, block_size=block_size,
                            cuda_graph=getattr(decoder.options, "cuda_graph", False),
                            compile=getattr(decoder.options, "compile", False), on_text=show)
    if args.prompts is None:
        sys.stdout.write("\n")
        for tokens, score in result.outputs.completions[0].candidates[1:]:
            print(f"[alternative, score {score:.4f}] {text_of(run.tokenizer, tokens)!r}", file=sys.stderr)
    else:
        for i, c in enumerate(result.outputs.completions):
            line = {"index": i, "prompt": prompts[i], "text": c.text, "finish_reason": c.finish_reason,
                    "tokens": len(c.tokens)}
            if c.candidates:
                line["candidates"] = [{"text": text_of(run.tokenizer, t), "score": s} for t, s in c.candidates]
            print(json.dumps(line, ensure_ascii=False))
    sys.stdout.flush()
    how = result.note or f"{cache} cache"  # a model's own engine says what stands for the cache
    print(f"{result.tokens} new tokens in {result.seconds:.2f} s: {result.tokens_per_s:,.0f} tokens/s "
          f"({len(prompts)} prompt{'s' if len(prompts) > 1 else ''}, {decoder.name}, {how})", file=sys.stderr)
    return 0
