"""One linear layer's forward, float32 against each quantised layer of lmlab-compress: microseconds per call.

Each arm computes y = x Wᵀ (no bias, as lmlab's linears) for one random ``nn.Linear`` (seed 0) on a
float32 input x of ``tokens`` rows, under ``torch.inference_mode``:

- **fp32**: ``F.linear`` on the float weight, the baseline of every ratio;
- **int8**: the ``int8`` method's ``Int8Linear`` (per-channel int8 weights, per-token int8
  activations quantised in the call, ``torch._int_mm``);
- **rtn int4 g32**: the ``rtn`` method's ``GroupQuantLinear`` (4 bits, groups of 32, asymmetric) as a
  model calls it: torch's int4 kernel on bfloat16 activations up to ``KERNEL_ROWS`` (8) rows, else
  its dequantised weight;
- **rtn dequantised**: the same layer's other path at every shape, the packed weight dequantised and
  ``F.linear`` called on each call;
- **int4pack fp32 / bf16**: torch's own int4 CPU kernel, ``aten._weight_int4pack_mm_for_cpu``, on
  the very codes, scales and zero points of the rtn layer (packed once, outside the timing, by
  ``aten._convert_weight_to_int4pack_for_cpu``), with a float32 input and with a bfloat16 one (x
  and the scales already bfloat16: the kernel on a bfloat16 model); ``n/a`` where this torch lacks
  the op or refuses the shape;
- **nf4**: the ``nf4`` method's ``NF4Linear`` (blocks of 64), dequantised by bitsandbytes' CPU
  kernel, then ``F.linear``.

Every arm at a shape gets the same number of rounds (median of ``--rounds``, 5); in a round each
arm makes ``--repeat`` calls in turn (default: as many as fill about 0.2 s, counted per arm from a
trial after warm-up), so that the machine's drift falls on all arms alike. A cell reads
``µs per call (arm's time / fp32's time)``: below 1 is faster than float32. A second table gives
each arm's largest absolute output difference from fp32 at one shape (8 tokens, 1024 → 4096): the
int4pack arm at float32 should equal the dequantised rtn layer to rounding, since they hold the same weights.

    python bench/quant_linear.py [--threads 1] [--shapes 1x128x512 8x1024x4096 ...] [--repeat N] [--rounds 5]
"""

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

#: (tokens, in_features, out_features)
SHAPES = [(1, 128, 512), (1, 1024, 4096), (8, 1024, 4096), (64, 128, 512), (512, 128, 512), (512, 1024, 4096)]
#: where the output differences are measured (one shape: they compare numbers, not speed)
ERROR_SHAPE = (8, 1024, 4096)
ARMS = ("fp32", "int8", "rtn int4 g32", "rtn dequantised", "int4pack fp32", "int4pack bf16", "nf4")
#: seconds one arm's calls take in one round when --repeat is not given
ROUND_SECONDS = 0.2


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        tokens, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is TOKENSxINxOUT, e.g. 8x1024x4096") from None
    return tokens, k, n


def int4pack_arm(rtn, dtype: torch.dtype):
    """torch's int4 CPU kernel on the rtn layer's weights, as a call of x (tokens, K) in ``dtype``;
    None (and why, on stderr) where this torch cannot run it."""
    try:
        codes = rtn.codes().to(torch.int32)
        # innerKTiles (1) is ignored on the CPU; the packed layout follows the CPU's vector width.
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # The kernel reads w = (q − 8) · scale + zero, per (group, output): the rtn layer's
        # (q − z) · s is that with zero = (8 − z) · s. Scales must be in the input's dtype.
        s, z = rtn.scales.float(), rtn.zeros.float()
        scales_and_zeros = torch.stack((s, (8 - z) * s), -1).transpose(0, 1).contiguous().to(dtype)
        group = rtn.group_size

        def call(x):
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)

        call(torch.zeros(1, rtn.in_features, dtype=dtype))
        return call
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        print(f"int4pack {dtype}: n/a ({type(e).__name__}: {str(e).splitlines()[0][:160]})", file=sys.stderr)
        return None


def build(k: int, n: int) -> dict:
    """Every arm for one (in, out) weight, as name → (call, whether it takes bfloat16 input), None for n/a."""
    from lmlab_compress.grouped import RoundToNearest
    from lmlab_compress.int8 import Int8
    from lmlab_compress.nf4 import NF4

    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False).eval()
    # Each method's own quantize(), with the options its name takes by default (rtn: 4 bits, groups of 32).
    int8 = Int8().quantize("layer", linear, None)
    rtn = RoundToNearest(RoundToNearest.Options(bits=4, group_size=32)).quantize("layer", linear, None)
    nf4 = NF4().quantize("layer", linear, None)
    weight = linear.weight.detach()
    fp32_pack, bf16_pack = int4pack_arm(rtn, torch.float32), int4pack_arm(rtn, torch.bfloat16)
    return {"fp32": (lambda x: F.linear(x, weight), False), "int8": (int8, False), "rtn int4 g32": (rtn, False),
            "rtn dequantised": (lambda x: F.linear(x, rtn.dequantize()), False),
            "int4pack fp32": fp32_pack and (fp32_pack, False), "int4pack bf16": bf16_pack and (bf16_pack, True),
            "nf4": (nf4, False)}


def per_call(call, x, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call(x)
    return (time.perf_counter() - start) / calls


def calls_for(call, x, seconds: float) -> int:
    """Calls that take about ``seconds``, from a trial of at least 20 ms."""
    calls = 1
    while (spent := per_call(call, x, calls) * calls) < 0.02:
        calls *= 2
    return max(1, math.ceil(seconds / (spent / calls)))


@torch.inference_mode()
def time_shape(tokens: int, k: int, n: int, repeat: int | None, rounds: int) -> dict[str, float | None]:
    """Median seconds per call of each arm at this shape (None for n/a)."""
    arms = build(k, n)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    inputs = {name: x.bfloat16() if arm and arm[1] else x for name, arm in arms.items()}
    live = [name for name, arm in arms.items() if arm]
    for name in live:  # warm-up: first calls allocate, pick kernels, import bitsandbytes' backend
        per_call(arms[name][0], inputs[name], 3)
    counts = {name: repeat or calls_for(arms[name][0], inputs[name], ROUND_SECONDS) for name in live}
    times = {name: [] for name in live}
    for r in range(rounds):
        # A different arm goes first each round, so no arm always follows the same neighbour's cache state.
        for name in live[r % len(live):] + live[:r % len(live)]:
            times[name].append(per_call(arms[name][0], inputs[name], counts[name]))
    return {name: statistics.median(times[name]) if name in times else None for name in ARMS}


@torch.inference_mode()
def differences(tokens: int, k: int, n: int) -> tuple[dict[str, tuple[float, float] | None], float]:
    """Each arm's (max |y − y_fp32|, max |y − y_rtn|) on one input, and max |y_fp32| for scale."""
    arms = build(k, n)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    out = {name: arm[0](x.bfloat16() if arm[1] else x).float() if arm else None for name, arm in arms.items()}

    def gap(y, ref):
        return float((y - ref).abs().max())

    return ({name: None if y is None else (gap(y, out["fp32"]), gap(y, out["rtn dequantised"])) for name, y in out.items()},
            float(out["fp32"].abs().max()))


def label(shape: tuple[int, int, int]) -> str:
    tokens, k, n = shape
    return f"{tokens} × {k} → {n}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (torch.set_num_threads)")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES, metavar="TOKENSxINxOUT",
                        help="shapes to time (default: " + " ".join("x".join(map(str, s)) for s in SHAPES) + ")")
    parser.add_argument("--repeat", type=int, default=None,
                        help=f"calls per arm per round (default: about {ROUND_SECONDS} s of them, per arm and shape)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"quantised linear forward: torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} thread(s), median of {args.rounds} rounds, "
          f"{args.repeat or f'~{ROUND_SECONDS} s of'} calls per arm per round; µs per call (× fp32's time)")
    print()
    print("| tokens × in → out | " + " | ".join(ARMS) + " |")
    print("| --- | " + " | ".join("---:" for _ in ARMS) + " |")
    for shape in args.shapes:
        t = time_shape(*shape, args.repeat, args.rounds)
        base = t["fp32"]
        cells = [f"{base * 1e6:,.1f}"] + [f"{t[a] * 1e6:,.1f} ({t[a] / base:.2f}×)" if t[a] is not None else "n/a"
                                          for a in ARMS[1:]]
        print(f"| {label(shape)} | " + " | ".join(cells) + " |", flush=True)

    diffs, scale = differences(*ERROR_SHAPE)
    print()
    print(f"Output differences at {label(ERROR_SHAPE)} (max |y_fp32| = {scale:.4f}):")
    print()
    print("| arm | max abs diff vs fp32 | max abs diff vs rtn dequantised |")
    print("| --- | ---: | ---: |")
    for name in ARMS:
        d = diffs[name]
        print(f"| {name} | " + (f"{d[0]:.3g} | {d[1]:.3g}" if d else "n/a | n/a") + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
