"""``lmlab plan MANIFEST``: memory per device and communication per step of each variant, before running.

Builds each variant's model on fake tensors (no memory), asks its parallel plugin how it lays the
state out and prints parameters, gradients, optimizer states, activations and the peak per device,
and the bytes each device sends per optimizer step; see ``lmlab.plan`` for the method. Imports torch
and the plugins the manifest names, never lightning, deepspeed or wandb (peft only when the manifest's
peft plugin is built on it).

Exit status: 0 when every variant fits ``--device-mem`` (or none was given), 1 when some variant does
not (so ``lmlab plan m.toml --device-mem 80GB && lmlab run m.toml`` only runs what fits), 2 bad input
or a variant that cannot be planned (the others are still printed). A ``[peft]`` adapter is applied
as in a run: the frozen base has no gradients or optimizer states and saves fewer activations.
"""

import sys

from lmlab.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("manifest", help="path to a TOML manifest")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a manifest value (repeatable), e.g. --set parallel.use=ddp")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="plan for N processes in all (default: what the parallel plugin's options say)")
    parser.add_argument("--device-mem", default=None, metavar="SIZE",
                        help="memory of one device, e.g. 80GB or 80GiB: warn (and exit 1) where a variant "
                             "does not fit")


def main(args) -> int:
    from lmlab import manifest
    from lmlab.plan import parse_size, plan_variant
    from lmlab.plan.measure import CannotPlan

    if args.devices is not None and args.devices < 1:
        raise UserError(f"must be at least 1, got {args.devices}", key="--devices")
    capacity = parse_size(args.device_mem) if args.device_mem is not None else None
    variants = manifest.load(args.manifest, args.overrides)
    misfits = unplanned = 0
    for i, variant in enumerate(variants):
        if i:
            print()
        try:
            plan = plan_variant(variant, args.devices)
        except CannotPlan as exc:  # the other variants are still worth planning
            print(f"# variant: {variant.name}\ncannot plan: {exc}")
            print(f"error: variant {variant.name}: {exc}", file=sys.stderr)
            unplanned += 1
            continue
        print(render(plan, args.devices), end="")
        if capacity is not None:
            misfits += not report_fit(plan, capacity, args.device_mem)
    return 2 if unplanned else 1 if misfits else 0


def render(plan, requested_devices: int | None = None) -> str:
    from lmlab.plan import human, pick_unit

    d, f, s, t = plan.device, plan.facts, plan.shape, plan.train
    layout = d.layout
    unit = pick_unit(d.total)
    lines = [f"# variant: {plan.name}",
             f"model: {f.params:,} parameters ({_count(f.params)}; {f.trainable:,} trainable), "
             f"{s.n_layers} layers, d_model {s.d_model}, {s.n_heads} heads, block {s.block_size}, vocab {s.vocab_size}",
             f"run: {plan.parallel} on {layout.devices} device{'s' if layout.devices != 1 else ''} "
             f"({layout.data_parallel} data-parallel), precision {t.precision}, {plan.optimizer}, "
             f"micro-batch {t.batch_size} × {s.block_size} tokens, grad_accum {t.grad_accum}, "
             f"checkpointing {t.checkpointing}"]
    if requested_devices is not None and requested_devices != layout.devices:
        lines.append(f"note: {plan.parallel} uses {layout.devices} device(s), not the {requested_devices} asked for")
    lines += [f"note: {note}" for note in layout.notes]

    def share(fraction: float) -> str:
        if fraction == 1:
            return "full copy"
        if fraction > 0 and abs(1 / fraction - round(1 / fraction)) < 1e-9:
            return f"1/{round(1 / fraction)} of the model"
        return f"{100 * fraction:.3g} % of the model"

    offloaded = " (in host memory)"
    rows = [
        ("parameters", d.params, f"{d.param_dtype}, {share(layout.params)}"
         + (offloaded if layout.offload_params else "")),
        ("gradients", d.grads, f"{d.grad_dtype}, {share(layout.grads)}"
         + (", kept between steps" if layout.persistent_grads else "")),
        ("optimizer states", d.optimizer, f"{plan.optimizer}{' + fp32 master weights' if layout.master_weights else ''}, "
         f"{share(layout.optimizer)}" + (offloaded if layout.offload_optimizer else "")),
        ("activations", d.activations, f"saved for backward, one micro-batch"
         + (f" × {layout.activations:.3g}" if layout.activations != 1 else "")),
    ]
    if d.gathered:
        gathered = "all" if layout.gathered == 1 else share(layout.gathered).removesuffix(" of the model")
        rows.append(("gathered parameters", d.gathered, f"{gathered} of the model unsharded at once"))
    if d.grad_buffers:
        rows.append(("gradient buckets", d.grad_buffers, "communication buffers"))
    rows.append(("backward working", d.transient, "largest activation's gradient"
                 + (", one recomputed block" if t.checkpointing != "none" else "")))
    for phase, value in d.phases.items():
        rows.append((f"peak: {phase}", value, ""))
    rows.append(("total", d.total, f"the peak, during {d.peak_phase}"))
    lines.append(f"per device ({unit}, 1 GB = 10^9 bytes):")
    lines += [f"  {name:<22}{value / (1e9 if unit == 'GB' else 1e6):>12.3f}  {note}".rstrip() for name, value, note in rows]
    if d.host:
        lines.append(f"host memory per process: {human(d.host)} (offloaded)")
    lines.append(f"communication per step, per device: {human(d.comm_bytes)} sent")
    for c, volume in d.comm:
        per = f", {t.grad_accum}× per step (each micro-batch)" if c.per == "micro-batch" and t.grad_accum > 1 else ""
        note = f" ({c.note})" if c.note else ""
        lines.append(f"  {c.op} of {c.of} among {c.group}: {human(volume)}{per}{note}")
    if not d.comm:
        lines.append("  none")
    return "\n".join(lines) + "\n"


def report_fit(plan, capacity: float, text: str) -> bool:
    """Print whether the plan fits ``capacity`` bytes per device; True when it does."""
    from lmlab.plan import human

    total = plan.device.total
    if total <= capacity:
        print(f"fits: {human(total)} of {text} per device ({100 * total / capacity:.0f} %)")
        return True
    print(f"WARNING: {plan.name} does not fit: needs {human(total)} per device, more than --device-mem {text} "
          f"by {human(total - capacity)} (peak during {plan.device.peak_phase}); shard more (a parallel plugin "
          f"that shards: `lmlab plugins parallel`), use more devices, a smaller batch_size with grad_accum, or checkpointing",
          file=sys.stdout)
    return False


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
