"""The comparison's plots, drawn with matplotlib (imported only when a report is asked for).

- ``curves``: validation and training loss against step, one line per variant (the mean over its seeds
  at each step) with a band of ± one standard deviation over seeds;
- ``metric``: the compared metric, every seed as a dot and the mean ± std as a bar, the baseline's
  mean as a line: the spread a conclusion must beat is in plain sight;
- ``throughput`` and ``memory``: tokens/s (median over seeds, range as error bar) and memory per variant.
"""

import statistics

from lmlab.report.runs import RunSet
from lmlab.report.table import Comparison


def figures(comparison: Comparison, runset: RunSet) -> dict:
    """name → matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9})
    colors = {row.variant: plt.cm.tab10(i % 10) for i, row in enumerate(comparison.rows)}
    return dict(curves=_curves(plt, comparison, runset, colors), metric=_metric(plt, comparison, colors),
                throughput=_throughput(plt, comparison, runset, colors), memory=_memory(plt, comparison, colors))


def _curves(plt, c: Comparison, runset: RunSet, colors):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "val_loss", "validation loss"), (axes[1], "train_loss", "training loss")):
        for row in c.rows:
            per_seed = [_series(run.metrics, key) for run in runset.runs if run.name in row.seeds]
            steps = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
            if not steps:
                continue
            means = [statistics.fmean(s[step] for s in per_seed) for step in steps]
            ax.plot(steps, means, color=colors[row.variant], label=f"{row.variant} (n={len(per_seed)})", lw=1.5)
            if len(per_seed) > 1:
                spread = [statistics.stdev(s[step] for s in per_seed) for step in steps]
                ax.fill_between(steps, [m - d for m, d in zip(means, spread)], [m + d for m, d in zip(means, spread)],
                                color=colors[row.variant], alpha=0.2, lw=0)
        ax.set_title(f"{title} (band: ± 1 std over seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def _series(metrics: list[dict], key: str) -> dict[int, float]:
    """step → value of ``key`` in periodic records (the closing full-split validation is left out: it is
    measured on more data than the points of the curve)."""
    return {r["step"]: r[key] for r in metrics if key in r and not r.get("final") and r.get("step") is not None}


def _metric(plt, c: Comparison, colors):
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(c.rows) + 2), 4))
    for i, row in enumerate(c.rows):
        ax.scatter([i] * len(row.values), row.values, color=colors[row.variant], s=18, zorder=3)
        ax.errorbar([i + 0.15], [row.mean], yerr=[[row.std or 0], [row.std or 0]], fmt="D", ms=5,
                    color=colors[row.variant], capsize=4)
    baseline = next(row for row in c.rows if row.variant == c.baseline)
    ax.axhline(baseline.mean, color="gray", ls="--", lw=1, label=f"baseline mean ({c.baseline})")
    ax.set_xticks(range(len(c.rows)), [_wrap(row.variant) for row in c.rows], fontsize=8)
    ax.set_ylabel(c.metric)
    ax.set_title(f"{c.metric}: each seed (dots), mean ± std (diamond)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _throughput(plt, c: Comparison, runset: RunSet, colors):
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(c.rows) + 2), 3.5))
    for i, row in enumerate(c.rows):
        values = [r.summary.get("tokens_per_s") for r in runset.runs if r.name in row.seeds]
        values = [v for v in values if isinstance(v, (int, float))]
        if not values:
            continue
        mid = statistics.median(values)
        ax.bar(i, mid, color=colors[row.variant], yerr=[[mid - min(values)], [max(values) - mid]], capsize=4)
    ax.set_xticks(range(len(c.rows)), [_wrap(row.variant) for row in c.rows], fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("training throughput (median over seeds, range as error bar)")
    fig.tight_layout()
    return fig


def _memory(plt, c: Comparison, colors):
    # Two panels: a step's own state is often a small fraction of the process's peak, and one shared
    # axis would flatten it to nothing.
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2 * len(c.rows) + 3), 3.5))
    for ax, attr, title in ((axes[0], "step_mb", "one training step (activations + parameter state)"),
                            (axes[1], "peak_mem_mb", "process peak")):
        for i, row in enumerate(c.rows):
            value = getattr(row, attr)
            if value is not None:
                ax.bar(i, value, color=colors[row.variant])
        ax.set_xticks(range(len(c.rows)), [_wrap(row.variant) for row in c.rows], fontsize=8)
        ax.set_ylabel("MB")
        ax.set_title(f"memory: {title}")
    fig.tight_layout()
    return fig


def _wrap(name: str, width: int = 18) -> str:
    """Variant names are long comma lists; break them at commas so tick labels stay readable."""
    parts, line, lines = name.split(","), "", []
    for part in parts:
        if line and len(line) + len(part) + 1 > width:
            lines.append(line + ",")
            line = part
        else:
            line = f"{line},{part}" if line else part
    lines.append(line)
    return "\n".join(lines)
