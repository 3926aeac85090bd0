"""Failures that explain themselves: an exception that ended a run, turned into a Diagnosis (kind,
cause, evidence, fixes computed for this run), the seeds' crash table as code.

Kinds: out-of-memory (device or host), collective-timeout, non-finite, hang, and error for
anything else. ``summary.json`` records the result under ``diagnosis``; ``lmlab run`` prints it
under the error line and ``lmlab doctor`` prints it again later.
"""

import json
import math
import re
from pathlib import Path

from lmlab.api.monitor import Diagnosis, Fix, RunFailed
from lmlab.collective_timeout import collective_timeout, exception_chain, is_collective_timeout

_OOM = re.compile(r"out of memory|can't allocate memory|cannot allocate memory|DefaultCPUAllocator", re.I)


def diagnose(exc: BaseException, variant=None, run_dir: Path | None = None, facts: dict | None = None) -> Diagnosis:
    """What ended the run. ``facts``: what the run knew when it failed (``step``, ``lr``,
    ``activation_bytes``, ``device``, ``first_nonfinite``; ``capacity_bytes`` and ``device_count``
    to diagnose against other than this machine's)."""
    facts = facts or {}
    if isinstance(exc, RunFailed):
        given = exc.diagnosis
        if given.kind != "non-finite":
            return given
        # A monitor saw it first (nan-guard): the run's learning rate, clipping, precision and fixes join.
        usual = non_finite(given.cause, variant, facts)
        evidence = given.evidence + [line for line in usual.evidence if line not in given.evidence
                                     and not (line.startswith("first non-finite") and "first non-finite" in
                                              " ".join(given.evidence))]
        return Diagnosis(given.kind, given.cause, evidence=evidence, fixes=given.fixes or usual.fixes)
    text = f"{type(exc).__name__}: {exc}"
    if _is_oom(exc):
        return out_of_memory(exc, variant, facts)
    if type(exc).__name__ == "Diverged" or "non-finite" in text or re.search(r"\bnan\b", str(exc), re.I):
        return non_finite(str(exc), variant, facts)
    if is_collective_timeout(exc):
        return collective_timeout(exc, variant, run_dir, facts.get("late_ranks"))
    return Diagnosis("error", text.splitlines()[0], evidence=[f"step {facts['step']}"] if "step" in facts else [],
                     fixes=[Fix("read the traceback in the run folder's error.log")])


def _is_oom(exc: BaseException) -> bool:
    import torch

    return any(isinstance(e, (torch.OutOfMemoryError, MemoryError)) or
               (isinstance(e, RuntimeError) and _OOM.search(str(e))) for e in exception_chain(exc))


def nonfinite_fixes(run, lr: float | None) -> list[Fix]:
    """What to change after a non-finite loss or gradient, most likely first (``run``: the variant's
    RunSettings, None when unknown)."""
    fixes = []
    peak = _peak_lr(run)
    if peak is not None:
        fixes.append(Fix(f"a third of the peak learning rate ({peak:g}): the usual cause is a rate too high",
                         "optimizer.lr", float(f"{peak / 3:.3g}")))
    if run is None or not run.grad_clip:
        fixes.append(Fix("clip the gradient norm (0.1·sqrt(n_layers)): one bad batch cannot then blow up the weights",
                         "train.grad_clip", "auto"))
    if run is not None and run.train.precision == "16-mixed":
        fixes.append(Fix("bfloat16 has float32's exponent range, so activations and gradients do not overflow",
                         "train.precision", "bf16-mixed"))
    uses = list(run.uses("monitor") or ()) if run is not None else []
    recovering = _recovering_monitors()
    if recovering and not any(name in recovering for name in uses):
        name, (what, options) = next(iter(recovering.items()))
        fixes.append(Fix(what, "monitor.use", [*uses, name],
                         also={f"monitor.{name}.{key}": value for key, value in options.items()}))
    return fixes


def _peak_lr(run) -> float | None:
    """The peak learning rate trained with (``[resolved] lr``, else the optimizer's ``lr``)."""
    if run is None:
        return None
    if run.resolved is not None and run.resolved.lr is not None:
        return run.resolved.lr
    lr = getattr(run.options("optimizer"), "lr", None) if run.uses("optimizer") else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _recovering_monitors() -> dict:
    """Installed monitor name → its [nonfinite_recovery][lmlab.api.monitor.Monitor.nonfinite_recovery],
    for those that declare one, by name."""
    from lmlab import discovery

    found = {}
    for name in sorted({info.name for info in discovery.installed().get("monitor", [])}):
        try:
            recovery = discovery.load("monitor", name, key="monitor.use").nonfinite_recovery()
        except Exception:  # noqa: BLE001 - a plugin that cannot load here suggests nothing
            continue
        if recovery is not None:
            found[name] = recovery
    return found


def non_finite(message: str, run, facts: dict) -> Diagnosis:
    evidence = []
    if facts.get("first_nonfinite"):
        evidence.append(f"first non-finite: {facts['first_nonfinite']}")
    if facts.get("lr") is not None and math.isfinite(facts["lr"]):
        evidence.append(f"learning rate then: {facts['lr']:.3g}")
    if run is not None:
        clip = run.grad_clip
        evidence.append(f"gradient clipping: {'off' if not clip else f'on, at {clip:g}'}")
        evidence.append(f"precision: {run.train.precision}")
    return Diagnosis("non-finite", message.splitlines()[0], evidence=evidence,
                     fixes=nonfinite_fixes(run, facts.get("lr")))


def out_of_memory(exc: BaseException, variant, facts: dict) -> Diagnosis:
    device = facts.get("device", "cpu")
    on_gpu = device.startswith("cuda") or "CUDA" in str(exc)
    where = "device" if on_gpu else "host"
    evidence = [str(exc).splitlines()[0][:300]]
    if facts.get("step") is not None:
        evidence.append(f"in step {facts['step'] + 1} ({facts['step']} completed)")
    elif facts.get("stage"):
        evidence.append(facts["stage"])
    facts = {**facts, "capacity_bytes": facts.get("capacity_bytes") or capacity_bytes("cuda" if on_gpu else "cpu")}
    if on_gpu and not facts.get("device_count"):
        import torch

        facts["device_count"] = torch.cuda.device_count()
    fixes = memory_fixes(variant, facts) if variant is not None else []
    if facts["capacity_bytes"]:
        evidence.append(f"{where} memory: {_mb(facts['capacity_bytes'])}")
    return Diagnosis("out-of-memory", f"the {where} ran out of memory", evidence=evidence, fixes=fixes)


def memory_fixes(variant, facts: dict) -> list[Fix]:
    """Fixes computed for this run: an activation-checkpointing policy and what it saves (from the
    planner), a micro-batch × grad_accum split that keeps the global batch, and on GPUs
    (``facts["device_count"]``) each parallel plugin's first layout that fits them."""
    train = variant.train
    fixes = []
    saved = _planned_activations(variant)
    if train.checkpointing == "none":
        if saved is not None:
            freed = saved.get("none", 0) - saved.get("full", 0)
            fixes.append(Fix(f"recompute each block in backward: activations {_mb(saved.get('none'))} → "
                             f"{_mb(saved.get('full'))} per micro-batch (saves {_mb(freed)}), at about a third "
                             "more compute", "train.checkpointing", "full"))
        else:
            fixes.append(Fix("recompute each block in backward (less activation memory, more compute)",
                             "train.checkpointing", "full"))
    if train.batch_size > 1:
        act = saved.get(train.checkpointing) if saved else facts.get("activation_bytes")
        fixes.append(_smaller_micro_batch(train.batch_size, train.grad_accum, act, facts.get("capacity_bytes")))
    if facts.get("capacity_bytes") and facts.get("device_count"):  # a GPU's: sharding over several may fit
        fixes.extend(_fitting_layouts(variant, facts["capacity_bytes"], facts["device_count"]))
    return fixes


def _smaller_micro_batch(batch: int, accum: int, activations: float | None, capacity: float | None) -> Fix:
    """A micro-batch small enough that its activations take a quarter of the memory at most (what
    is left holds weights, states and the rest), with the accumulation that keeps ``batch × accum``
    sequences per optimizer step: a smaller micro-batch alone would shrink the step's batch and change
    the training. A divisor of ``batch`` keeps it exactly; where none is near, the micro-batch rounds
    down and the accumulation to the nearest step batch, and the fix says what that changes."""
    need = 2  # shrink at least 2×: the current micro-batch did not fit
    if activations and capacity:
        need = max(need, math.ceil(activations / (capacity / 4)))
    need = min(need, batch)
    per_step = batch * accum
    # A divisor up to twice the shrink needed: a micro-batch at least half the size that would fit.
    k = next((k for k in range(need, min(batch, 2 * need) + 1) if batch % k == 0), None)
    micro = batch // k if k else batch // need
    new_accum = max(1, round(per_step / micro))
    shrink = batch / micro
    note = f", activations about {_mb(activations / shrink)} instead of {_mb(activations)}" if activations else ""
    if micro * new_accum == per_step:
        what = (f"a micro-batch {shrink:.3g}× smaller and {new_accum / accum:.3g}× the accumulation: the same "
                f"{per_step} sequences (batch_size × grad_accum) per optimizer step{note}")
    else:
        what = (f"a micro-batch of {micro}, {new_accum} per optimizer step{note}; {batch} is not divisible by "
                f"{need}: {micro * new_accum} sequences per optimizer step instead of {per_step} (scale the "
                "learning rate by as much, or pick another split)")
    return Fix(what, "train.batch_size", micro, also={"train.grad_accum": new_accum})


def capacity_bytes(device: str) -> float | None:
    """The memory the run had: the GPU's, or the host's (its address-space limit when one is set)."""
    import resource

    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    limits = [resource.getrlimit(resource.RLIMIT_AS)[0]]
    try:
        import os

        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        pass
    finite = [x for x in limits if x and x > 0 and x != resource.RLIM_INFINITY]
    return float(min(finite)) if finite else None


def _planned_activations(variant) -> dict | None:
    """Activation bytes per micro-batch under each checkpointing policy, from the planner; None when
    the planner cannot measure this variant."""
    import dataclasses

    from lmlab.plan.measure import plan_variant

    out = {}
    try:
        for policy in ("none", "full"):
            train = variant.train.model_copy(update={"checkpointing": policy})
            out[policy] = plan_variant(dataclasses.replace(variant, train=train)).facts.activation_bytes
    except Exception:  # noqa: BLE001 - a fix without figures beats no diagnosis
        return None
    return out


def _fitting_layouts(variant, capacity: float, count: int) -> list[Fix]:
    """For each installed parallel plugin, the first of its
    [memory_savings][lmlab.api.parallel.Parallel.memory_savings] that the planner fits into ``count``
    GPUs of ``capacity`` bytes (with a tenth to spare), as the plugin and its options to set."""
    from lmlab import discovery
    from lmlab.plan.measure import plan_variant

    current = variant.slots.get("parallel")
    fixes = []
    for name in sorted({info.name for info in discovery.installed().get("parallel", [])}):
        try:
            cls = discovery.load("parallel", name, key="parallel.use")
            savings = cls.memory_savings()
        except Exception:  # noqa: BLE001 - a plugin that cannot load here suggests nothing
            continue
        for what, options in savings:
            if current is not None and current.plugin is cls and all(
                    getattr(current.options, key, None) == value for key, value in options.items()):
                continue  # the layout that ran out
            try:
                candidate = variant.with_plugin("parallel", cls, cls.Options(devices=count, **options))
                peak = plan_variant(candidate, world_size=count).device.total
            except Exception:  # noqa: BLE001 - not plannable for this variant: try the next
                continue
            if peak <= 0.9 * capacity:
                fixes.append(Fix(f"{what}, over {count} GPUs: the planner puts the peak at {_mb(peak)} of "
                                 f"{_mb(capacity)} per device (lmlab plan says more)", "parallel.use", name,
                                 also={f"parallel.{key}": value for key, value in options.items()}))
                break
    return fixes


def _mb(nbytes) -> str:
    from lmlab.plan.arithmetic import human

    return "?" if nbytes is None else human(nbytes)


def render(diagnosis: dict) -> str:
    """The diagnosis as ``lmlab run`` and ``lmlab doctor`` print it."""
    lines = [f"diagnosis: {diagnosis['kind']}: {diagnosis['cause']}"]
    lines += [f"  evidence: {line}" for line in diagnosis.get("evidence", [])]
    for fix in diagnosis.get("fixes", []):
        settings = {fix["key"]: fix["value"], **fix.get("also", {})} if fix.get("key") else {}
        where = " (" + " ".join(f"--set {key}={_toml(value)}" for key, value in settings.items()) + ")" \
            if settings else ""
        lines.append(f"  fix: {fix['text']}{where}")
    return "\n".join(lines)


def _toml(value) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ",".join(_toml(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)
