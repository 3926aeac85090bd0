"""Training-step memory of architecture variants: activations autograd saves for backward plus
parameters, gradients and AdamW state, measured the way `lmlab run` reports `activation_mb` and
`state_mb` (device-independent, unlike a CPU process's peak resident set).

    python bench/step_memory.py "attention.use=mha" "attention.use=mamba,position.use=none" ...

Each argument is one variant: comma-separated overrides of experiments/shakespeare-char.toml.
"""

import sys

from stepper import ModelStepper

from lmlab.model import compute_loss
from lmlab.train.memory import SavedBytes, state_bytes


def step_memory(overrides: list[str]) -> tuple[float, float]:
    stepper = ModelStepper(overrides)
    stepper.steps(1)  # creates the optimizer state
    windows = stepper.tokens[:(stepper.T + 1) * stepper.B].view(stepper.B, stepper.T + 1)
    saved = SavedBytes()
    with saved:
        compute_loss(stepper.model, stepper.objective, stepper.objective.make_batch(windows)).total.backward()
    return saved.total / 2**20, state_bytes(stepper.model, [stepper.optimizer]) / 2**20


def main() -> None:
    variants = sys.argv[1:] or ["attention.use=mha"]
    print(f"{'variant':<52} {'activations MB':>15} {'state MB':>9} {'step MB':>8}")
    for variant in variants:
        act, state = step_memory([o for o in variant.split(",") if o])
        print(f"{variant:<52} {act:15.1f} {state:9.1f} {act + state:8.1f}")


if __name__ == "__main__":
    main()
