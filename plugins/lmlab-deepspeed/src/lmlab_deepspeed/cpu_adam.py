"""The host optimizer step under ZeRO-Offload: DeepSpeed's CPU Adam, or torch's AdamW.

With ``offload_optimizer = "cpu"`` the optimizer state lives in host memory and the step runs on
the CPU, once per step over every parameter of the rank's partition: for the users who offload,
that step is the bottleneck. DeepSpeed ships a vectorised Adam for it (``DeepSpeedCPUAdam``, a C++
op with SIMD loops over the fp32 master weights, built with the system compiler on first use and
cached under ``~/.cache/torch_extensions``). lmlab's ``adamw`` optimizer plugin makes a
``torch.optim.AdamW``; where the op builds, the strategy steps the same parameter groups with CPU
Adam in AdamW mode instead (the groups are shared, so the learning-rate schedule that sets their
``lr`` reaches it). The option ``cpu_adam`` chooses: ``auto`` (CPU Adam where it builds, else
torch's AdamW with one warning line), ``deepspeed`` (CPU Adam or exit 2) or ``torch``. The
resolved choice is recorded in ``provenance.json`` (``plugins.parallel.resolved``).
"""

import sys

import torch

from lmlab.api import UserError


def build_problem() -> str | None:
    """Why DeepSpeed's CPU Adam cannot be used here (None: it is built, or was built before)."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builder = CPUAdamBuilder()
        if not builder.is_compatible(verbose=False):
            return "DeepSpeed finds the op incompatible with this machine"
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - a missing compiler, headers, ninja: all mean "cannot"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}{': ' + first[:200] if first else ''}"
    return None


def resolve(choice: str, offload: bool) -> dict:
    """What steps the host optimizer: ``{"optimizer_step": "deepspeed-cpu-adam" | "torch-adamw" |
    "device", "why": ...}``; builds the op when it may be used."""
    if not offload:
        return {"optimizer_step": "device", "why": "the optimizer is not offloaded"}
    if choice == "torch":
        return {"optimizer_step": "torch-adamw", "why": "parallel.cpu_adam = \"torch\""}
    problem = build_problem()
    if problem is None:
        return {"optimizer_step": "deepspeed-cpu-adam", "why": f"parallel.cpu_adam = \"{choice}\""}
    if choice == "deepspeed":
        raise UserError(f"DeepSpeed's CPU Adam cannot be built here ({problem}); use cpu_adam = \"auto\" or "
                        "\"torch\"", key="parallel.cpu_adam")
    print(f"lmlab: warning: DeepSpeed's CPU Adam cannot be built here ({problem}); the offloaded optimizer "
          "steps with torch's AdamW instead", file=sys.stderr, flush=True)
    return {"optimizer_step": "torch-adamw", "why": f"cpu_adam = \"auto\" and the op did not build: {problem}"}


def host_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` (torch's AdamW) as DeepSpeed's CPU Adam in AdamW mode over the same groups."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if type(optimizer) is not torch.optim.AdamW or any(g.get("amsgrad") for g in optimizer.param_groups):
        raise UserError(f"DeepSpeed's CPU Adam replaces AdamW, and the [optimizer] made a {type(optimizer).__name__}"
                        " (use = \"adamw\", without amsgrad); set parallel.cpu_adam = \"torch\"",
                        key="parallel.cpu_adam")
    class SharedGroupsCPUAdam(DeepSpeedCPUAdam):
        def load_state_dict(self, state_dict):
            # torch's load_state_dict makes new group dicts; the schedule sets lr on the shared ones.
            shared = self.param_groups
            super().load_state_dict(state_dict)
            for mine, loaded in zip(shared, self.param_groups):
                mine.update(loaded)
            self.param_groups = shared

    first = optimizer.param_groups[0]
    host = SharedGroupsCPUAdam([p for g in optimizer.param_groups for p in g["params"]], lr=first["lr"],
                            betas=first["betas"], eps=first["eps"], weight_decay=first["weight_decay"],
                            adamw_mode=True)
    for group in optimizer.param_groups:
        group.setdefault("bias_correction", True)
    # The same group dicts: each group's lr, betas, eps and weight decay (no decay on norms and
    # biases) are read at every step, and the schedule that sets lr on them reaches this optimizer.
    host.param_groups = optimizer.param_groups
    return host
