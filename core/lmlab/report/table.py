"""One row per variant, seeds pooled, each tested against a baseline variant.

Honest by construction: every row says how many seeds it pools, the spread over them and the smallest
value; the p-value is Welch's t-test against the baseline, and a variant whose difference from the
baseline is within what its seeds' spread explains is marked "≈ baseline" (not distinguishable)
rather than ranked as better or worse. A variant with a single seed gets no test at all.
"""

import math
import statistics
from dataclasses import dataclass, field

from lmlab.errors import UserError
from lmlab.variant import seedless
from lmlab.report.runs import RunSet
from lmlab.report.stats import Welch, mean_std, welch

#: Summary metrics where more is better; for every other one (losses, memory, time) less is.
HIGHER_IS_BETTER = {"tokens_per_s", "accuracy", "acc"}
#: Task metrics (``TASK/METRIC``, from ``lmlab eval --tasks``) where lower is better; the others
#: (acc, acc_norm, exact_match, ...) are scores.
LOWER_TASK_METRICS = ("perplexity", "bits_per_byte", "loss")


def higher_is_better(metric: str) -> bool:
    if "/" in metric:
        return not any(word in metric.split("/", 1)[1] for word in LOWER_TASK_METRICS)
    return metric in HIGHER_IS_BETTER


def metric_value(summary: dict, metric: str):
    """The summary's value of ``metric``: a top-level figure (``val_loss``), or ``TASK/METRIC`` from the
    task scores ``lmlab eval --tasks`` wrote under ``eval``."""
    if "/" in metric:
        task, _, name = metric.partition("/")
        scores = summary.get("eval")
        return scores.get(task, {}).get(name) if isinstance(scores, dict) else None
    return summary.get(metric)


def _reported(summary: dict) -> list[str]:
    scores = summary.get("eval") if isinstance(summary.get("eval"), dict) else {}
    return [k for k, v in summary.items() if _is_number(v)] + [
        f"{task}/{name}" for task, values in scores.items() if isinstance(values, dict)
        for name, v in values.items() if _is_number(v)]


@dataclass
class Row:
    variant: str
    values: list[float]  # the metric, one per completed seed
    seeds: list[str]  # the run names those values come from
    mean: float
    std: float | None
    best: float
    test: Welch | None  # against the baseline; None for the baseline itself or too few seeds
    tokens_per_s: float | None
    peak_mem_mb: float | None
    step_mb: float | None
    params: int | None
    failed: list[str] = field(default_factory=list)  # runs of this variant that did not complete

    def verdict(self, baseline: str, alpha: float, higher_is_better: bool) -> str:
        if self.variant == baseline:
            return "baseline"
        if self.test is None:
            return "n<2: untested"
        if self.test.p >= alpha:
            return "≈ baseline"
        better = (self.test.t > 0) == higher_is_better
        return "better" if better else "worse"


@dataclass
class Comparison:
    source: str
    metric: str
    baseline: str
    alpha: float
    rows: list[Row]  # sweep order when known, else by mean, best first
    incomplete: list[tuple[str, str]]  # (run, status and error) of runs left out

    @property
    def higher_is_better(self) -> bool:
        return higher_is_better(self.metric)


def summarize(runset: RunSet, metric: str = "val_loss", baseline: str | None = None,
              alpha: float = 0.05) -> Comparison:
    completed = [r for r in runset.runs if r.completed]
    incomplete = [(r.name, _why(r.summary)) for r in runset.runs if not r.completed]
    if not completed:
        raise UserError("holds no completed runs (every summary.json has a status other than completed)",
                        key=runset.source)
    missing = [r.name for r in completed if not _is_number(metric_value(r.summary, metric))]
    if missing:
        having = sorted({k for r in completed for k in _reported(r.summary)})
        if len(missing) == len(completed):
            raise UserError(f"no run reports {metric!r}; the runs report: {', '.join(having)}", key="--metric")
        raise UserError(f"runs of different metrics: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                        f"report no {metric!r} while the others do; compare a metric all runs have, or remove "
                        "those runs from the folder", key=runset.source)

    groups: dict[str, list] = {}
    for run in completed:
        groups.setdefault(run.group, []).append(run)
    failed: dict[str, list[str]] = {}
    for run in runset.runs:
        if not run.completed:
            failed.setdefault(run.group, []).append(run.name)
    order = [g for g in runset.order if g in groups] + sorted(g for g in groups if g not in runset.order)
    if baseline is None:
        baseline = order[0]
    elif seedless(baseline) in groups:
        baseline = seedless(baseline)  # a run's name given for its variant's
    else:
        from lmlab.errors import did_you_mean

        raise UserError(f"no variant {baseline!r} among the completed runs{did_you_mean(baseline, list(groups))}; "
                        f"the variants are: {', '.join(order)}", key="--baseline")
    reference = [metric_value(r.summary, metric) for r in groups[baseline]]
    rows = []
    for name in order:
        runs = groups[name]
        values = [float(metric_value(r.summary, metric)) for r in runs]
        mean, std = mean_std(values)
        step_mb = [r.summary["activation_mb"] + r.summary["state_mb"] for r in runs
                   if _is_number(r.summary.get("activation_mb")) and _is_number(r.summary.get("state_mb"))]
        rows.append(Row(
            variant=name, values=values, seeds=[r.name for r in runs], mean=mean, std=std,
            best=max(values) if higher_is_better(metric) else min(values),
            test=None if name == baseline else welch(values, reference),
            tokens_per_s=_median(r.summary.get("tokens_per_s") for r in runs),
            peak_mem_mb=_max(r.summary.get("peak_mem_mb") for r in runs),
            step_mb=max(step_mb) if step_mb else None,
            params=runs[0].summary.get("params"), failed=failed.get(name, [])))
    if not runset.order:  # no sweep order to keep: best first
        rows.sort(key=lambda row: -row.mean if higher_is_better(metric) else row.mean)
    return Comparison(runset.source, metric, baseline, alpha, rows, incomplete)


def format_table(c: Comparison) -> str:
    """The terminal table with a legend under it."""
    best_label = "max" if c.higher_is_better else "min"
    header = ("variant", "n", f"{c.metric} mean ± std", best_label, "p vs baseline", "", "tokens/s", "step MB",
              "peak MB", "params")
    lines = []
    for row in c.rows:
        spread = f" ± {row.std:.4f}" if row.std is not None else ""
        failed = f" (+{len(row.failed)} failed)" if row.failed else ""
        lines.append((row.variant, f"{len(row.values)}{failed}", f"{row.mean:.4f}{spread}", f"{row.best:.4f}",
                      _p(row.test), row.verdict(c.baseline, c.alpha, c.higher_is_better),
                      f"{row.tokens_per_s:,.0f}" if row.tokens_per_s is not None else "-",
                      f"{row.step_mb:,.1f}" if row.step_mb is not None else "-",
                      f"{row.peak_mem_mb:,.0f}" if row.peak_mem_mb is not None else "-",
                      f"{row.params:,}" if row.params is not None else "-"))
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) if i in (0, 5) else cell.rjust(w)
                     for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
           for r in [header, tuple("-" * w for w in widths), *lines]]
    out.append("")
    out.append(f"{c.metric}: {'higher' if c.higher_is_better else 'lower'} is better. p: Welch's two-sided t-test "
               f"against the baseline ({c.baseline}) over seeds; ≈ baseline: p ≥ {c.alpha:g}, the difference is "
               "within what the seeds' spread explains (not distinguishable). Each p-value tests one pair: among k "
               f"variants no better than the baseline, about k × {c.alpha:g} pass by chance.")
    out.append("step MB: what one training step holds (activations saved for backward + parameters, gradients, "
               "optimizer state); peak MB: the variant's own peak, counted from its start (on a GPU the memory "
               "allocated on the device; on a CPU the process's resident set, which includes what the process "
               "already held, such as its libraries; outside Linux, where it cannot be reset, the process's "
               "peak over every variant it ran before, unless they ran with --jobs).")
    for name, why in c.incomplete:
        out.append(f"left out: {name} ({why})")
    return "\n".join(out)


def _p(test: Welch | None) -> str:
    if test is None:
        return "-"
    return f"{test.p:.2g}" if test.p >= 1e-4 else "<1e-4"


def _why(summary: dict) -> str:
    status = summary.get("status", "no status")
    error = summary.get("error")
    return f"{status}: {error}" if error else status


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _median(values) -> float | None:
    numbers = [v for v in values if _is_number(v)]
    return statistics.median(numbers) if numbers else None


def _max(values) -> float | None:
    numbers = [v for v in values if _is_number(v)]
    return max(numbers) if numbers else None
