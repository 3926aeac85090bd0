"""Training-step time of a mixture-of-experts model against the dense model it extends, same run.

The quickstart's baby GPT (experiments/shakespeare-char.toml: 4 layers, d_model 128, block 64,
batch 12) with its dense ``mlp`` and with ``moe`` (4 experts, each as wide as the dense MLP:
hidden = 4 x d_model) routing top-1 (Switch) and top-2 (GShard / Mixtral), dropless (the default: no
capacity limit).
One step = forward, backward, gradient clipping and an AdamW step on random windows of the corpus. The models
take turns in windows of ``--every`` steps so machine noise hits all alike; printed are the median
time per step of each and the ratios moe / dense (target for top-2: <= 2.5).

    OMP_NUM_THREADS=1 python bench/moe_speed.py [--windows 12] [--every 10] [--warmup 10]
"""

import argparse

import torch

from stepper import ModelStepper, interleaved_medians

VARIANTS = {
    "dense mlp": ["ffn.use=mlp"],
    "moe top-1": ["ffn.use=moe", "ffn.n_experts=4", "ffn.top_k=1"],
    "moe top-2": ["ffn.use=moe", "ffn.n_experts=4", "ffn.top_k=2"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=12, help="timed windows per model")
    parser.add_argument("--every", type=int, default=10, help="steps per window")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per model first")
    args = parser.parse_args()
    steppers = {name: ModelStepper(overrides) for name, overrides in VARIANTS.items()}
    medians = interleaved_medians(steppers, args.windows, args.every, args.warmup)
    dense = medians["dense mlp"]
    print(f"threads {torch.get_num_threads()} | {args.windows} interleaved windows of {args.every} steps")
    for name, median in medians.items():
        print(f"{name:10}  {median * 1e3:7.2f} ms/step  {steppers[name].params / 1e6:5.2f}M params  "
              f"ratio to dense {median / dense:5.2f}")
    print(f"moe top-2 / dense = {medians['moe top-2'] / dense:.2f}  (target <= 2.5)")


if __name__ == "__main__":
    main()
