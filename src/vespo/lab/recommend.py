"""The recommendation at the top of the results page: which loss to use where, from paired evidence.

The claims file names the settings:

    recommend:
      - {setting: "synchronous training, N updates per rollout batch", sweep: staleness, among: loss, over: N}
      - {setting: "fully asynchronous training", sweep: async, among: loss}
      - {setting: "4x as long", sweep: endpoint, among: loss, over: N, at: ["64"]}

At each value of `over` (or those `at` lists; once without `over`) the candidates (values of `among`)
are first grouped where their runs are identical on every common seed (identical updates: the
evidence cannot pick among them). Every two groups are then compared on the seeds they share (paired
t-test of held-out sampled accuracy, Holm over the setting's pairs). A loss is named only when it is
ahead of every other; otherwise the line names the losses no other is ahead of, tied, and picks none.
A loss ahead of another is never listed as tied with it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pandas as pd

from vespo.lab.claims import ROBUST_SEEDS, ROBUST_SHARE, ClaimsError, settling
from vespo.lab.grid import Sweep
from vespo.lab.runs import by_seed, select
from vespo.lab.stats import FAMILY_ERROR, Interval, Paired, ci_text, holm, mean_ci, p_value, paired
from vespo.plot import display_name

METRIC = "eval_sampled"
IDENTICAL = ("eval_sampled", "eval_greedy", "train_last", "max_grad_norm")  # equal on every common seed
SCALE_LIMITS = (
    "The lab's policy is a 2-layer, 128-wide model trained on reversing 16 letters (17-token answers) with "
    "exact-match rewards, on CPU. What ranks losses here need not rank them for a large model on long reasoning "
    "answers, where sequence weights span thousands of tokens and the learning rate, batch and clipping are tuned "
    "for that model; differences of a few points here say which losses are worth trying first, not which wins at "
    "scale. Engine mismatch here is simulated with a bf16 copy of the same weights, not an inference engine's "
    "kernels, and async timing comes from two CPU processes, not a cluster.")


@dataclass
class Pick:
    setting: str
    at: str  # "N = 64", or "" without an `over` axis
    updates: int  # the training budget
    groups: list[list[str]]  # candidates, those with identical runs together
    top: list[int]  # groups no other group is ahead of
    ahead: dict[tuple[int, int], Paired] = field(default_factory=dict)  # (i, j): group i ahead of j, i - j
    collapsed: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (collapsed, usable runs)
    level: Interval | None = None  # the named loss's held-out accuracy
    settling: dict[str, str] = field(default_factory=dict)  # name -> settled | still rising | ... (claims.settling)

    @property
    def named(self) -> str | None:
        i = self.top[0] if len(self.top) == 1 else None
        if i is None or len(self.groups[i]) > 1 or any((i, j) not in self.ahead for j in range(len(self.groups)) if j != i):
            return None
        return self.groups[i][0]


def recommend(entries: list[dict], sweeps: dict[str, Sweep], runs: pd.DataFrame) -> list[Pick]:
    picks = []
    for i, entry in enumerate(entries):
        unknown = set(entry) - {"setting", "sweep", "among", "over", "at"}
        if unknown or not {"setting", "sweep", "among"} <= set(entry) or not isinstance(entry.get("at", []), list):
            raise ClaimsError(f"recommend[{i}]: expected {{setting, sweep, among, over (optional), at (optional list)}}, "
                              f"got {entry}")
        if entry["sweep"] not in sweeps:
            continue
        values, among, over = sweeps[entry["sweep"]].values, entry["among"], entry.get("over")
        at = [str(v) for v in entry["at"]] if "at" in entry else None
        if among not in values or (over is not None and over not in values) or (at and set(at) - set(values[over])):
            raise ClaimsError(f"recommend[{i}]: sweep {entry['sweep']!r} has no axis {among!r} or {over!r}, or at {at} "
                              f"is not on it; axes: {values}")
        mine = runs[runs.sweep == entry["sweep"]]
        for v in [v for v in values[over] if at is None or v in at] if over else [None]:
            cells = select(mine, {over: v}) if over else mine
            if cells.usable.any():
                picks.append(pick(str(entry["setting"]), f"{over} = {v}" if over else "", cells, among))
    return picks


def pick(setting: str, at: str, runs: pd.DataFrame, among: str) -> Pick:
    names = [n for n in dict.fromkeys(runs[among]) if runs[(runs[among] == n) & runs.usable].shape[0]]
    cells = {n: runs[runs[among] == n] for n in names}
    groups: list[list[str]] = []
    for n in names:
        same = next((g for g in groups if identical(cells[g[0]], cells[n])), None)
        same.append(n) if same is not None else groups.append([n])
    values = [pd.concat([by_seed(cells[n], METRIC) for n in g]).groupby(level=0).first() for g in groups]
    pairs = list(itertools.permutations(range(len(groups)), 2))
    diffs = {(i, j): paired(values[i], values[j]) for i, j in pairs}
    tests = [(i, j) for i, j in pairs if i < j and diffs[(i, j)].diff.n >= 2]
    p = dict(zip(tests, holm([p_value(diffs[t].values.to_numpy(), 0.0) for t in tests])))
    ahead = {}
    for (i, j), adjusted in p.items():
        if adjusted < FAMILY_ERROR:
            i, j = (i, j) if diffs[(i, j)].diff.mean > 0 else (j, i)
            ahead[(i, j)] = diffs[(i, j)]
    out = Pick(setting, at, int(runs.updates.max()), groups, [i for i in range(len(groups))
                                                             if not any((k, i) in ahead for k in range(len(groups)))],
               ahead)
    for n, cell in cells.items():
        usable = cell[cell.usable]
        if usable.collapsed.any():
            out.collapsed[n] = (int(usable.collapsed.sum()), len(usable))
    out.settling = {n: settling(cell)[1] for n, cell in cells.items()}
    if out.named is not None:
        out.level = mean_ci(by_seed(cells[out.named], METRIC))
    return out


def identical(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Whether two candidates' runs are identical on every seed both have (at least two)."""
    diffs = [paired(by_seed(a, m), by_seed(b, m)).values for m in IDENTICAL]
    return diffs[0].size >= 2 and all(d.size == diffs[0].size and (d == 0).all() for d in diffs)


# ---------------------------------------------------------------- in words


def recommendation_markdown(picks: list[Pick]) -> str:
    if not picks:
        return "No sweep of the recommendation's settings has run yet."
    lines = []
    for setting in dict.fromkeys(p.setting for p in picks):
        lines += [f"**{setting[0].upper() + setting[1:]}**", ""]
        lines += [f"- {_advice(p)}" for p in picks if p.setting == setting] + [""]
    lines += [f"Losses are compared two by two "
              f"on the seeds both have (paired t-test, Holm over the line's pairs, family-wise error {FAMILY_ERROR:.0%}); "
              "a difference is the loss ahead minus the other, with its 90% interval and how many seeds it is higher in "
              f"(*robust*: at least {ROBUST_SHARE:.0%} of at least {ROBUST_SEEDS}). A loss is named only when it is ahead "
              "of every other; \"tied\" means no test tells them apart, not that they are equal; losses whose runs are "
              "identical seed by seed make the same updates, and no evidence can pick among them.", "",
              f"What this scale cannot say: {SCALE_LIMITS}"]
    return "\n".join(lines)


def _advice(p: Pick) -> str:
    def names(i: int) -> str:
        return " = ".join(display_name(n) for n in p.groups[i])

    head = (p.at + ", " if p.at else "") + f"held-out sampled accuracy after {p.updates} updates: "
    if p.named is not None:
        text = head + f"use **{display_name(p.named)}** (held-out {ci_text(p.level)})"
    else:
        same = [names(i) for i in p.top if len(p.groups[i]) > 1]
        text = head + "the evidence picks none" + "".join(f"; identical updates: {s}" for s in same)
        tied = [names(i) for i in p.top if len(p.groups[i]) == 1]
        if tied:
            text += f"; {'tied with them' if same else 'tied'}: " + ", ".join(tied)
    parts = []
    for j in (j for j in range(len(p.groups)) if j not in p.top):
        i = next((i for i in [*p.top, *range(len(p.groups))] if (i, j) in p.ahead), None)
        if i is not None:
            d = p.ahead[(i, j)]
            label = "robust" if d.diff.n >= ROBUST_SEEDS and d.wins >= ROBUST_SHARE * d.diff.n else "supported"
            parts.append(f"{names(j)} behind {names(i)} by {ci_text(d.diff, True)}, higher in {d.wins}/{d.diff.n} seeds "
                         f"({label})")
    if parts:
        text += "; " + "; ".join(parts)
    words = list(p.settling.values())
    if any(w != "–" for w in words):
        text += f"; curves at this budget: {words.count('settled')} of {len(words)} settled, " \
                f"{words.count('still rising')} still rising"
    if p.collapsed:
        text += "; collapsed runs: " + ", ".join(f"{display_name(n)} {k}/{m}" for n, (k, m) in p.collapsed.items())
    return text

