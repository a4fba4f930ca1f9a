"""The learning-rate range: per loss, the widest interval of learning rates with no collapsed run.

A learning rate is *stable* for a condition when every run at it finished and none collapsed
(every seed: one collapse out of three makes it unstable). The range is the widest run of
consecutive stable grid learning rates, its width the ratio high / low (1 for a single rate);
ties go to the interval with the better reward. Its reward is the best mean over seeds at one
learning rate inside it, with its interval.

    ranges = lr_ranges(record, results)          one LrRange per condition without the lr axis
    ranges[0].low, ranges[0].high, ranges[0].width, ranges[0].best
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vespo.lab.results import RunResult, by_seed, conditions, group, order
from vespo.lab.stats import Interval, mean_ci

LR_AXIS = "lr"


@dataclass(frozen=True)
class LrPoint:
    lr: float
    label: str  # the grid's value label
    runs: int  # usable runs (finished, or stopped for non-finite updates)
    missing: int  # runs not finished or failed
    collapsed: int
    reward: Interval  # the metric's mean over seeds

    @property
    def stable(self) -> bool:
        return self.runs > 0 and self.missing == 0 and self.collapsed == 0


@dataclass(frozen=True)
class LrRange:
    condition: dict[str, str]  # labels of the other axes, e.g. {"loss": "vespo"}
    points: list[LrPoint]  # ascending learning rate
    low: float | None  # the widest stable interval; None when no learning rate is stable
    high: float | None
    best: LrPoint | None  # the point with the best mean reward inside the interval

    @property
    def width(self) -> float:
        return self.high / self.low if self.low else math.nan


def lr_of(runs: list[RunResult], label: str) -> float:
    """The learning rate of a grid value: from the runs' configs, else the label itself."""
    for r in runs:
        lr = (r.config.get("optim") or {}).get("lr")
        if lr is not None:
            return float(lr)
    try:
        return float(label)
    except ValueError:
        raise ValueError(f"lr axis value {label!r}: no run config with optim.lr and not a number") from None


def lr_ranges(record: dict, results: list[RunResult], metric: str = "eval_sampled",
              lr_axis: str = LR_AXIS) -> list[LrRange]:
    axes = conditions(record)
    if lr_axis not in axes:
        raise ValueError(f"sweep {record['name']!r} has no {lr_axis!r} axis; axes: {axes}")
    others = [a for a in axes if a != lr_axis]
    out = []
    for key, runs in sorted(group(results, others).items(), key=lambda kv: order(record, others, kv[0])):
        points = sorted((_point(label, lr_runs, metric) for (label,), lr_runs in group(runs, [lr_axis]).items()),
                        key=lambda p: p.lr)
        low, high, best = widest_stable(points)
        out.append(LrRange(dict(zip(others, key)), points, low, high, best))
    return out


def _point(label: str, runs: list[RunResult], metric: str) -> LrPoint:
    usable = [r for r in runs if r.usable]
    return LrPoint(lr_of(runs, label), label, len(usable), len(runs) - len(usable),
                   sum(r.collapse.collapsed for r in usable), mean_ci(list(by_seed(runs, metric).values())))


def widest_stable(points: list[LrPoint]) -> tuple[float | None, float | None, LrPoint | None]:
    """(low, high, best point) of the widest run of consecutive stable points (ascending lr)."""
    spans, start = [], None
    for i, p in enumerate(points + [None]):
        if p is not None and p.stable:
            start = i if start is None else start
        elif start is not None:
            spans.append(points[start:i])
            start = None
    if not spans:
        return None, None, None

    def best_of(span: list[LrPoint]) -> LrPoint:
        return max(span, key=lambda p: _score(p.reward.mean))

    span = max(spans, key=lambda s: (s[-1].lr / s[0].lr, _score(best_of(s).reward.mean)))
    return span[0].lr, span[-1].lr, best_of(span)


def lr_text(lr: float) -> str:
    """5e-05 -> "5e-5", 0.00025 -> "2.5e-4"."""
    mantissa, exponent = f"{lr:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _score(x: float) -> float:
    return x if math.isfinite(x) else -math.inf
