"""Percentiles and ratios, the same way for every scenario."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (p in 0..100)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def latency_summary(values_ms: Iterable[float]) -> dict[str, float]:
    """n, p50, p90, p99, max and mean of latencies in milliseconds (rounded for reading)."""
    ordered = sorted(values_ms)
    if not ordered:
        return {"n": 0, "p50_ms": math.nan, "p90_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan,
                "mean_ms": math.nan}
    return {
        "n": len(ordered),
        "p50_ms": round(percentile(ordered, 50), 3),
        "p90_ms": round(percentile(ordered, 90), 3),
        "p99_ms": round(percentile(ordered, 99), 3),
        "max_ms": round(ordered[-1], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
    }


def ratio(herald: float | None, baseline: float | None) -> float | None:
    """herald / baseline, or None when either is missing or the baseline is 0."""
    if herald is None or baseline is None:
        return None
    if any(isinstance(v, float) and math.isnan(v) for v in (herald, baseline)) or baseline == 0:
        return None
    return round(herald / baseline, 3)


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(clean) if clean else math.nan
