"""Training-step memory of architecture variants: activations autograd saves for backward plus
parameters, gradients and AdamW state, measured the way `lmlab run` reports `activation_mb` and
`state_mb` (device-independent, unlike a CPU process's peak resident set).

    python bench/step_memory.py "attention.use=mha" "attention.use=mamba,position.use=none" ...

Each argument is one variant: comma-separated overrides of experiments/shakespeare-char.toml.
"""

import sys

import torch

from stepper import ModelStepper

from lmlab.model import compute_loss
from lmlab.train.module import SavedBytes


def step_memory(overrides: list[str]) -> tuple[float, float]:
    stepper = ModelStepper(overrides)
    stepper.steps(1)  # creates the optimizer state
    windows = stepper.tokens[:(stepper.T + 1) * stepper.B].view(stepper.B, stepper.T + 1)
    saved = SavedBytes()
    with saved:
        compute_loss(stepper.model, stepper.objective, stepper.objective.make_batch(windows)).total.backward()
    params = list(stepper.model.parameters())
    state = 2 * sum(p.numel() * p.element_size() for p in params) + sum(
        v.numel() * v.element_size() for s in stepper.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return saved.total / 2**20, state / 2**20


def main() -> None:
    variants = sys.argv[1:] or ["attention.use=mha"]
    print(f"{'variant':<52} {'activations MB':>15} {'state MB':>9} {'step MB':>8}")
    for variant in variants:
        act, state = step_memory([o for o in variant.split(",") if o])
        print(f"{variant:<52} {act:15.1f} {state:9.1f} {act + state:8.1f}")


if __name__ == "__main__":
    main()
