"""Generation speed: lmlab's decoding against Hugging Face ``generate`` and a hand-written KV-cache
loop on identical weights; batched throughput with both caches; speculative decoding's speed-up.

1. Batch 1, greedy: a Llama-shaped model with seeded random weights (transformers'
   LlamaForCausalLM, converted with ``lmlab_architectures.hf_llama.from_hf``) continues a prompt by
   ``--new`` tokens four ways: ``generate(do_sample=False)``; the same plain loop around
   transformers' forward and ``DynamicCache`` (what ``generate`` adds shows beside it); the plain
   loop over lmlab's model (prefill, then one token per forward through the model's own
   ``KVCache``, argmax); and lmlab's path (``Decoder.generate``: the engine, the ``greedy`` plugin,
   per-row stopping). All must agree token for token; and lmlab's path again with ``decoding.compile = true`` (the engine's one-token
   step compiled once by torch.compile; the compile time is printed, not counted). Printed: tokens/s
   (median of interleaved rounds) and the ratios lmlab / HF (target ≥ 2) and lmlab / plain loop
   (target ≥ 0.95), eager and compiled.
2. Batches of 1, 8 and 32 prompts of different lengths (8 to 48 tokens), each continued by
   ``--new`` tokens, with the contiguous and the paged cache: total tokens/s, and the share of the
   cache's reserved positions that held tokens at the peak.
3. With ``--target RUN --draft RUN`` (``lmlab run experiments/decoding.toml``: 8 layers and a
   2-layer draft), greedy against speculative greedy (k = 4) over prompts of the corpus: tokens/s,
   their ratio and the acceptance rate, after checking the texts are identical.
4. On a CUDA device only: lmlab's greedy step eager, replayed as a CUDA graph
   (``decoding.cuda_graph``) and compiled, on the same weights, identical tokens.

    python bench/decoding.py [--new 200] [--rounds 5] [--target DIR --draft DIR] [--only 1|2|3|4]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def llama(layers: int = 4, width: int = 128, heads: int = 4, vocab: int = 96, context: int = 512):
    from support import random_llama

    hf = random_llama(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=context,
                      tie_word_embeddings=False)
    # An untrained model's logits are nearly flat: rounding differences between implementations would
    # flip near-ties. Sharpened, every argmax is clear and the three continuations must agree.
    with torch.no_grad():
        hf.lm_head.weight.mul_(40)
    return hf


@torch.no_grad()
def plain_loop(model, prompt: torch.Tensor, new: int) -> list[int]:
    """Prefill, then one token per forward through the model's own cache: the baseline to match."""
    cache = model.new_cache(1, prompt.shape[1] + new)
    logits = model(prompt, cache=cache)[:, -1]
    out = []
    for i in range(new):
        token = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
        out.append(token)
        if i < new - 1:
            logits = model(token, cache=cache)[:, -1]
    return torch.cat(out, dim=1)[0].tolist()


@torch.no_grad()
def lmlab_greedy(model, prompt: torch.Tensor, new: int) -> list[int]:
    from lmlab import discovery

    decoder = discovery.load("decoding", "greedy")()
    return decoder.generate(model, prompt, new)[0, prompt.shape[1]:].tolist()


class CompiledGreedy:
    """lmlab's greedy path with a static decode step (``decoding.compile = true``, or
    ``decoding.cuda_graph = true``; None: eager), over one engine kept across calls as a server keeps it."""

    def __init__(self, model, length: int, static: str | None = "compile"):
        from lmlab import discovery
        from lmlab.generation.engine import make_engine

        self.decoder = discovery.load("decoding", "greedy")()
        self.engine = make_engine(model, 1, length, compile=static == "compile", cuda_graph=static == "cuda_graph")

    @torch.no_grad()
    def __call__(self, prompt: torch.Tensor, new: int) -> list[int]:
        from lmlab.generation.token_ids import run_decoder
        from lmlab.generation.outputs import Outputs

        outputs = Outputs(None, [new])
        for _ in run_decoder(self.decoder, self.engine, prompt.tolist(), outputs):
            pass
        return outputs.completions[0].tokens


@torch.no_grad()
def hf_loop(hf, prompt: torch.Tensor, new: int) -> list[int]:
    """The plain loop around transformers' own forward and cache: what ``generate`` adds shows beside it."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = hf(prompt, past_key_values=cache, use_cache=True).logits[:, -1]
    out = []
    for i in range(new):
        token = logits.argmax(dim=-1, keepdim=True)
        out.append(token)
        if i < new - 1:
            logits = hf(token, past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.cat(out, dim=1)[0].tolist()


@torch.no_grad()
def hf_greedy(hf, prompt: torch.Tensor, new: int) -> list[int]:
    # An explicit mask: without one, generate masks every prompt token equal to pad_token_id.
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, prompt.shape[1]:].tolist()


def timed(fn, *args) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = fn(*args)
    return time.perf_counter() - start, tokens


def batch_one(new: int, rounds: int) -> None:
    from lmlab import pretrained
    from lmlab_architectures.hf_llama import from_hf

    hf = llama()
    model = from_hf(hf, pretrained.build).eval()
    prompt = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    print(f"1. batch 1, greedy, {new} new tokens after 16, Llama-shaped 4 x 128 (identical weights, identical tokens)")
    compiled = CompiledGreedy(model, prompt.shape[1] + new)
    arms = {"hf generate": lambda: hf_greedy(hf, prompt, new), "hf plain loop": lambda: hf_loop(hf, prompt, new),
            "plain loop": lambda: plain_loop(model, prompt, new),
            "lmlab greedy": lambda: lmlab_greedy(model, prompt, new), "lmlab compiled": lambda: compiled(prompt, new)}
    times = {name: [] for name in arms}
    results = {}
    for name, fn in arms.items():  # warm up (and compile, once)
        seconds, results[name] = timed(fn)
        if name == "lmlab compiled":
            print(f"   (compiling the decode step: {seconds:.1f} s, once per engine)")
    if len({str(r) for r in results.values()}) != 1:
        raise SystemExit(f"the greedy continuations differ: {results}")
    for _ in range(rounds):
        for name, fn in arms.items():
            seconds, _ = timed(fn)
            times[name].append(seconds)
    rate = {name: new / statistics.median(t) for name, t in times.items()}
    for name, r in rate.items():
        print(f"   {name:<14} {r:8,.0f} tokens/s")
    print(f"   lmlab / hf generate = {rate['lmlab greedy'] / rate['hf generate']:.2f}, compiled "
          f"{rate['lmlab compiled'] / rate['hf generate']:.2f} (target >= 2)")
    print(f"   lmlab / plain loop  = {rate['lmlab greedy'] / rate['plain loop']:.3f}, compiled "
          f"{rate['lmlab compiled'] / rate['plain loop']:.2f} (target >= 0.95)")


@torch.no_grad()
def batched(new: int) -> None:
    from lmlab import discovery
    from lmlab.generation.token_ids import run_decoder
    from lmlab.generation.engine import make_engine
    from lmlab.generation.outputs import Outputs
    from lmlab import pretrained
    from lmlab_architectures.hf_llama import from_hf

    model = from_hf(llama(), pretrained.build).eval()
    greedy = discovery.load("decoding", "greedy")()
    g = torch.Generator().manual_seed(1)
    print(f"2. batched greedy, prompts of 8-48 tokens, {new} new tokens each (same model)")
    print("   batch  cache        tokens/s   cache use at peak")
    for batch in (1, 8, 32):
        prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 49, (batch,), generator=g)]
        for cache in ("contiguous", "paged"):
            # Both caches are sized for the longest sequence the context allows (512), as a server must.
            engine = make_engine(model, batch, 512, cache=cache, block_size=16)
            outputs = Outputs(None, [new] * batch)
            peak = 0.0
            start = time.perf_counter()
            for _ in run_decoder(greedy, engine, prompts, outputs):
                stored = sum(engine.lengths)
                peak = max(peak, stored / engine.store.reserved_positions())
            seconds = time.perf_counter() - start
            made = sum(len(c.tokens) for c in outputs.completions)
            print(f"   {batch:>5}  {cache:<11} {made / seconds:9,.0f}   {peak:6.0%}")


@torch.no_grad()
def speculative(target_dir: Path, draft_dir: Path, new: int, k: int = 4) -> None:
    from lmlab import discovery
    from lmlab.generation.batch import generate_texts
    from lmlab.generation.runs import prepare_decoder
    from lmlab.trained import load_run

    run = load_run(target_dir)
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    prompts = [text[i:i + 24] for i in range(1000, 1000 + 8 * 5000, 5000)]
    greedy = discovery.load("decoding", "greedy")()
    spec_cls = discovery.load("decoding", "speculative")
    spec = spec_cls(spec_cls.Options(draft=str(draft_dir), k=k))
    prepare_decoder(spec, run)
    print(f"3. speculative greedy (k = {k}), target {target_dir.name}, draft {draft_dir.name}; "
          f"{len(prompts)} prompts one at a time, {new} new tokens each")
    rates = {}
    texts = {}
    for name, decoder in (("greedy", greedy), ("speculative", spec)):
        generate_texts(run.model, run.tokenizer, decoder, prompts[:1], 8)  # warm up
        made = seconds = 0
        texts[name] = []
        if name == "speculative":
            spec.stats = {"proposed": 0, "accepted": 0}
        for p in prompts:
            result = generate_texts(run.model, run.tokenizer, decoder, [p], new)
            made += result.tokens
            seconds += result.seconds
            texts[name].append(result.outputs.completions[0].text)
        rates[name] = made / seconds
    if texts["greedy"] != texts["speculative"]:
        raise SystemExit("speculative greedy differs from greedy")
    stats = getattr(spec, "stats", {})
    acceptance = stats.get("accepted", 0) / max(stats.get("proposed", 0), 1)
    print(f"   greedy {rates['greedy']:,.0f} tokens/s, speculative {rates['speculative']:,.0f} tokens/s: "
          f"speed-up {rates['speculative'] / rates['greedy']:.2f}, acceptance {acceptance:.0%} (identical text)")


@torch.no_grad()
def cuda_graphs(new: int, rounds: int) -> None:
    """On a GPU: lmlab's greedy step eager, captured as a CUDA graph, and compiled, on the same weights."""
    from lmlab import pretrained
    from lmlab_architectures.hf_llama import from_hf

    if not torch.cuda.is_available():
        print("4. CUDA graphs: skipped (no CUDA device)")
        return
    model = from_hf(llama(), pretrained.build).cuda().eval()
    prompt = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    arms = {name: CompiledGreedy(model, 16 + new, static=static)
            for name, static in (("eager", None), ("cuda graph", "cuda_graph"), ("compiled", "compile"))}
    results = {name: arm(prompt, new) for name, arm in arms.items()}  # warm up, capture, compile
    if len({str(r) for r in results.values()}) != 1:
        raise SystemExit(f"the greedy continuations differ on the GPU: {results}")
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            torch.cuda.synchronize()
            seconds, _ = timed(arm, prompt, new)
            times[name].append(seconds)
    rate = {name: new / statistics.median(t) for name, t in times.items()}
    print(f"4. {torch.cuda.get_device_name()}: batch 1, greedy, {new} new tokens (identical tokens)")
    for name, r in rate.items():
        print(f"   {name:<11} {r:8,.0f} tokens/s  ({r / rate['eager']:.2f} x eager)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--draft", type=Path, default=None)
    parser.add_argument("--only", choices=("1", "2", "3", "4"), default=None)
    args = parser.parse_args(argv)
    if args.only in (None, "1"):
        batch_one(args.new, args.rounds)
    if args.only in (None, "2"):
        batched(args.new)
    if args.only in (None, "3") and args.target and args.draft:
        for k in (2, 4):
            speculative(args.target, args.draft, args.new, k=k)
    if args.only in (None, "4"):
        cuda_graphs(args.new, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
