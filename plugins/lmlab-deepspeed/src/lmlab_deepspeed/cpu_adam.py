"""The host optimizer step under ZeRO-Offload: DeepSpeed's CPU Adam, or torch's AdamW.

With ``offload_optimizer = "cpu"`` the optimizer state lives in host memory and the step runs on
the CPU, once per step over every parameter of the rank's partition: for the users who offload,
that step is the bottleneck. DeepSpeed ships a vectorised Adam for it (``DeepSpeedCPUAdam``, a C++
op with SIMD loops over the fp32 master weights, built with the system compiler on first use and
cached under ``~/.cache/torch_extensions``). It implements one update, AdamW's: where the
``[optimizer]`` plugin declares that its optimizer applies exactly that (``Optimizer.update_rule()
== "adamw"``, lmlab's ``adamw``) and the op builds, the strategy steps the same parameter groups with
CPU Adam in AdamW mode instead (the groups are shared, so the learning-rate schedule that sets their
``lr`` reaches it). The option ``cpu_adam`` chooses: ``auto`` (CPU Adam where it can stand in and
builds; any other optimizer is kept, without building the op; a failed build falls back to the
torch optimizer with one warning line), ``deepspeed`` (CPU Adam or exit 2) or ``torch``. The
resolved choice is recorded in ``provenance.json`` (``plugins.parallel.resolved``), and what the
engine actually stepped in ``summary.json`` (``optimizer_stepped``, see :func:`stepped`).
"""

import os
import sys

import torch

from lmlab.api import UserError
from lmlab_deepspeed.zero import cannot_stand_in


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


def resolve(choice: str, offload: bool, rule: str | None, optimizer: str = "the [optimizer]") -> dict:
    """What steps the host optimizer: ``{"optimizer_step": "deepspeed-cpu-adam" | "torch" | "device",
    "why": ...}``, where ``rule`` is the ``[optimizer]`` plugin's declared update rule
    (``Optimizer.update_rule``) and ``optimizer`` its name; builds the op only when it may be used."""
    if not offload:
        return {"optimizer_step": "device", "why": "the optimizer is not offloaded"}
    if choice == "torch":
        return {"optimizer_step": "torch", "why": "parallel.cpu_adam = \"torch\""}
    if rule != "adamw":
        if choice == "deepspeed":  # lmlab check refuses this first (DeepSpeedZeRO.check)
            raise UserError(cannot_stand_in(optimizer), key="parallel.cpu_adam")
        return {"optimizer_step": "torch", "why": f"cpu_adam = \"auto\" and {optimizer} does not apply AdamW's "
                                                  "update, the only one CPU Adam implements"}
    problem = build_problem()
    if problem is None:
        return {"optimizer_step": "deepspeed-cpu-adam", "why": f"parallel.cpu_adam = \"{choice}\""}
    if choice == "deepspeed":
        raise UserError(f"DeepSpeed's CPU Adam cannot be built here ({problem}); use cpu_adam = \"auto\" or "
                        "\"torch\"", key="parallel.cpu_adam")
    if _first_process():  # every rank resolves for itself; the run warns once
        print(f"lmlab: warning: DeepSpeed's CPU Adam cannot be built here ({problem}); the offloaded optimizer "
              "steps with torch's AdamW instead", file=sys.stderr, flush=True)
    return {"optimizer_step": "torch", "why": f"cpu_adam = \"auto\" and the op did not build: {problem}"}


def _first_process() -> bool:
    # The launchers (Lightning's, torchrun, SLURM) give every process but the first a non-zero rank.
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def stepped(engine) -> str:
    """What ``engine`` (a ``DeepSpeedEngine``) steps the parameters with, read from the engine itself
    (under ZeRO its optimizer wraps this one): ``"deepspeed-cpu-adam"``, or the torch optimizer's
    class (``"torch.optim.adamw.AdamW"``)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    optimizer = engine.basic_optimizer
    if isinstance(optimizer, DeepSpeedCPUAdam):
        return "deepspeed-cpu-adam"
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def host_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` (one whose plugin declares AdamW's update) as DeepSpeed's CPU Adam in AdamW mode
    over the same groups."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    for group in optimizer.param_groups:
        missing = {"lr", "betas", "eps", "weight_decay"} - group.keys()
        if missing or group.get("amsgrad") or group.get("maximize"):
            # resolve() let only a plugin declaring update_rule() == "adamw" get here: its contract broke.
            broken = f"lack {', '.join(sorted(missing))}" if missing else "ask for amsgrad or maximize"
            raise TypeError(f"the [optimizer] plugin declares AdamW's update (Optimizer.update_rule), but the "
                            f"param groups of its {type(optimizer).__name__} {broken}")
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
