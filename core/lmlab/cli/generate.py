"""``lmlab generate RUN_DIR``: text from a trained run, streamed to the terminal as it is made.

One ``--prompt`` streams its continuation; ``--prompts FILE`` (one prompt per line, or JSONL objects
with a ``"prompt"``) decodes them all as one batch and writes one JSON line per prompt as it
finishes. Either way the speed (new tokens per second) goes to stderr, with what the model's own
engine reports of how it decoded (``Engine.report``: early exit's average exit layer).

A run whose tokenizer has its model's chat template (``Tokenizer.chat_template``) also chats:
``--messages FILE`` answers a conversation (a JSON list of {"role", "content"}, or one such object per
line) and ``--chat`` holds one, a line of yours then the model's answer, until end of input.
"""

import json
import sys
from pathlib import Path

from lmlab.errors import UserError, warn


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a variant's run folder (holds manifest.toml)")
    parser.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                        help="prompts to continue as one batch: one per line, or JSONL with a \"prompt\" field")
    parser.add_argument("--messages", type=Path, default=None, metavar="FILE",
                        help="a conversation to answer through the model's chat template: a JSON list of "
                             "{\"role\", \"content\"}, or one per line")
    parser.add_argument("--chat", action="store_true",
                        help="talk with the model through its chat template, a line at a time (until end of input)")
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


def read_messages(path: Path) -> list[dict]:
    """A conversation file: a JSON list of messages, or JSONL with one message per line; each a
    {"role": system|user|assistant, "content": text}, the last the user's."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}", key="--messages") from exc
    try:
        messages = json.loads(text) if text.lstrip().startswith("[") else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})", key="--messages") from exc
    for n, message in enumerate(messages, 1):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise UserError(f"{path}: message {n} needs a role ({', '.join(ROLES)}) and a string content; got "
                            f"{json.dumps(message)[:80]}", key="--messages")
    if not messages or messages[-1]["role"] != "user":
        raise UserError(f"{path}: the last message must be the user's: the model answers it", key="--messages")
    return messages


ROLES = ("system", "user", "assistant")


def main(args) -> int:
    if args.messages is not None or args.chat:
        return chat(args)
    if args.max_new_tokens < 1:
        raise UserError("must be positive", key="--max-new-tokens")
    if any(s == "" for s in args.stop):
        raise UserError("a stop string cannot be empty", key="--stop")
    if args.prompt is not None and args.prompts is not None:
        raise UserError("give --prompt or --prompts, not both", key="--prompts")
    prompts = read_prompts(args.prompts) if args.prompts is not None else [args.prompt if args.prompt is not None else "\n"]

    from lmlab.generation.batch import generate_texts
    from lmlab.generation.runs import prepare_decoder
    from lmlab.trained import load_run, refuse_bidirectional

    run = load_run(args.run_dir, args.overrides)
    refuse_bidirectional(run.objective)
    decoder = run.plugins["decoding"]
    prepare_decoder(decoder, run)
    cache = args.cache or getattr(decoder.options, "cache", "contiguous")
    block_size = getattr(decoder.options, "block_size", 16)
    graphed = getattr(decoder.options, "cuda_graph", False)
    compiled = getattr(decoder.options, "compile", False)
    _say_about_static_step(graphed, compiled, cache, next(run.model.parameters()).device.type)
    show = None  # a batch is written as JSON lines at the end: no text to decode per step
    if args.prompts is None:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()

        def show(i, text):
            sys.stdout.write(text)
            sys.stdout.flush()

    result = generate_texts(run.model, run.tokenizer, decoder, prompts, args.max_new_tokens, stop=args.stop,
                            seed=args.seed, cache=cache, block_size=block_size,
                            cuda_graph=graphed, compile=compiled, on_text=show)
    if args.prompts is None:
        sys.stdout.write("\n")
        for text, score in result.outputs.candidate_texts(0)[1:]:
            print(f"[alternative, score {score:.4f}] {text!r}", file=sys.stderr)
    else:
        for i, c in enumerate(result.outputs.completions):
            line = {"index": i, "prompt": prompts[i], "text": c.text, "finish_reason": c.finish_reason,
                    "tokens": len(c.tokens)}
            if c.candidates:
                line["candidates"] = [{"text": t, "score": s} for t, s in result.outputs.candidate_texts(i)]
            print(json.dumps(line, ensure_ascii=False))
    sys.stdout.flush()
    how = result.note or f"{cache} cache"  # a model's own engine says what stands for the cache
    said = decoder.report()  # a speculative decoder's acceptance rate
    print(f"{result.tokens} new tokens in {result.seconds:.2f} s: {result.tokens_per_s:,.0f} tokens/s "
          f"({len(prompts)} prompt{'s' if len(prompts) > 1 else ''}, {decoder.name}, {how}"
          f"{'; ' + said if said else ''})", file=sys.stderr)
    return 0


def _say_about_static_step(graphed: bool, compiled: bool, cache: str, device: str) -> None:
    """The static one-token step (a CUDA graph, or torch.compile) runs over the contiguous cache, and a
    graph only on CUDA: a setting that cannot act says so instead of being dropped in silence, and a
    compile that will happen says so before it costs its seconds."""
    if graphed and device != "cuda":
        warn(f"decoding.cuda_graph: ignored on the {device} (a CUDA graph needs a CUDA device)")
    elif (graphed or compiled) and cache == "paged":
        warn(f"decoding.{'cuda_graph' if graphed else 'compile'}: ignored with the paged cache (the static step "
             "runs over the contiguous cache: --cache contiguous)")
    elif compiled and not (graphed and device == "cuda"):
        # Said before it happens: a cold compile of the step takes tens of seconds on a CPU.
        from lmlab.compile_cache import use_compile_cache

        print(f"decoding.compile: compiling the one-token step at its first use (cached in {use_compile_cache()}; "
              "its time is reported apart)", file=sys.stderr)


def chat(args) -> int:
    """--messages FILE: one answer; --chat: a conversation on stdin and stdout."""
    from lmlab.chat_template import prompt_text
    from lmlab.generation.batch import generate_texts
    from lmlab.generation.runs import prepare_decoder
    from lmlab.trained import load_run, refuse_bidirectional

    if args.prompt is not None or args.prompts is not None or (args.messages is not None and args.chat):
        raise UserError("give one of --prompt, --prompts, --messages, --chat", key="--messages" if args.messages
                        else "--chat")
    messages = read_messages(args.messages) if args.messages is not None else []
    run = load_run(args.run_dir, args.overrides)
    refuse_bidirectional(run.objective)
    data = run.plugins.get("data")
    own = data.conversation_template() if data is not None else None
    if own is None and run.tokenizer.chat_template() is None:
        raise UserError(f"its tokenizer ({run.variant.uses('tokenizer')}) has no chat template of the model's own: "
                        "chat needs a run started from a chat model's checkpoint; use --prompt", key=str(args.run_dir))
    decoder = run.plugins["decoding"]
    prepare_decoder(decoder, run)

    def answer(conversation: list[dict]) -> str:
        text = prompt_text(run.tokenizer, conversation, where=str(args.messages or "--chat"), template=own)
        result = generate_texts(run.model, run.tokenizer, decoder, [text], args.max_new_tokens, stop=args.stop,
                                seed=args.seed, on_text=lambda i, piece: (sys.stdout.write(piece), sys.stdout.flush()))
        sys.stdout.write("\n")
        sys.stdout.flush()
        return result.outputs.completions[0].text

    if not args.chat:
        answer(messages)
        return 0
    for line in sys.stdin:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        messages.append({"role": "assistant", "content": answer(messages)})
    return 0
