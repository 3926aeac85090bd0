"""Running lmlab from a plugin's tests without reaching into the core: the CLI in-process, a
manifest's one variant (with a stand-in plugin no manifest can name), a training run with extra hook
objects, and the learning-rate schedule a run follows (for checking what a monitor or optimizer saw)."""

from pathlib import Path


def main(argv: list[str]) -> int:
    """``lmlab ARGV...`` in this process; returns the exit status (2 for bad input, 1 for a failure)."""
    from lmlab.cli.main import main as cli

    return cli(list(argv))


def load_variant(path: str | Path, overrides=()):
    """The one variant of the manifest at ``path`` (``overrides``: ``--set`` items); replace a plugin
    with ``variant.with_plugin(slot, cls, options)``."""
    from lmlab import manifest

    variants = manifest.load(path, list(overrides))
    if len(variants) != 1:
        raise ValueError(f"{path} has {len(variants)} variants; give it no [sweep]")
    return variants[0]


def run_variant(variant, run_dir: str | Path, extra_hooks=(), resume: bool = False):
    """Train ``variant`` into ``run_dir``, with ``extra_hooks`` (objects with ``@hookimpl`` methods)
    registered beside its plugins; returns the run's result (``.summary``, ``.module``). A run that
    fails raises, after writing its summary.json."""
    from lmlab.train.runner import run_variant as run

    return run(variant, Path(run_dir), resume=resume, extra_hooks=list(extra_hooks))


def lr_at(variant, step: int) -> float:
    """The learning rate of the optimizer's first param group after ``step`` optimizer steps, as the
    run's schedule sets it (``train.lr_scaling`` included; the first group's peak is ``optimizer.lr``)."""
    from lmlab.train.schedule import lr_factor

    cfg = variant.train
    peak = variant.options("optimizer").lr * variant.lr_factor
    return peak * lr_factor(step, warmup=cfg.warmup_steps, decay_steps=cfg.decay_steps, min_ratio=cfg.min_lr / peak,
                            kind=cfg.lr_schedule, decay_fraction=cfg.decay_fraction)
