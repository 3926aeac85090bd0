"""Statistics over seeds: mean, sample standard deviation, and Welch's t-test between two variants.

Welch's test (unequal variances) because two architectures rarely have the same seed-to-seed spread.
The Student t distribution's tail comes from the regularized incomplete beta function, evaluated by
its continued fraction (Numerical Recipes §6.4), so ``lmlab compare`` needs no SciPy; the project's
tests check it against ``scipy.stats.ttest_ind(equal_var=False)``.
"""

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Welch:
    t: float
    df: float
    p: float  # two-sided


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value: one seed says nothing of spread)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def welch(a: list[float], b: list[float]) -> Welch | None:
    """Two-sided Welch t-test of mean(a) = mean(b); None when either side has fewer than two values."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        # No spread on either side: identical means are indistinguishable, different ones certain.
        return Welch(0.0 if ma == mb else math.copysign(math.inf, ma - mb), math.inf, 1.0 if ma == mb else 0.0)
    t = (ma - mb) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return Welch(t, df, student_t_two_sided(t, df))


def student_t_two_sided(t: float, df: float) -> float:
    """P(|T| ≥ |t|) for Student's t with ``df`` degrees of freedom: I_{df/(df+t²)}(df/2, 1/2)."""
    if math.isinf(t):
        return 0.0
    return min(1.0, max(0.0, incomplete_beta(df / 2, 0.5, df / (df + t * t))))


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # The continued fraction converges fast for x < (a+1)/(a+b+2); use the symmetry otherwise.
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float, tiny: float = 1e-300, eps: float = 3e-16) -> float:
    """Lentz's method for the continued fraction of I_x(a, b)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for numerator in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                          -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h
