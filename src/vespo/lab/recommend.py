"""The recommendation at the top of the results page: which loss to use where, from paired evidence.

At each setting of the claims file (`recommend`: vespo.lab.claims.Setting) the candidates with at least
MIN_SEEDS finished runs are grouped where their runs are identical seed by seed, and every two groups compared
on their common seeds (paired t-test, Holm over the setting's pairs); page.md says how a line reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pandas as pd

from vespo.lab.claims import ROBUST_SEEDS, ROBUST_SHARE, ClaimsError, Setting, settling
from vespo.lab.grid import Sweep
from vespo.lab.runs import by_seed, select
from vespo.lab.stats import FAMILY_ERROR, MIN_SEEDS, Interval, Paired, ci_text, holm, mean_ci, p_value, paired
from vespo.plot import display_name

METRIC = "eval_sampled"
IDENTICAL = ("eval_sampled", "eval_greedy", "train_last", "max_grad_norm")  # equal on every common seed


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
    few: dict[str, int] = field(default_factory=dict)  # candidates left out: name -> usable runs (< MIN_SEEDS)
    values: dict[str, pd.Series] = field(default_factory=dict)  # name -> its held-out accuracy per seed

    @property
    def leader(self) -> str | None:
        """The one candidate ahead of every other compared."""
        n = len(self.groups)
        return next((g[0] for i, g in enumerate(self.groups) if n > 1 and len(g) == 1
                     and all((i, j) in self.ahead for j in range(n) if j != i)), None)

    @property
    def named(self) -> str | None:  # the leader, when every candidate could be compared
        return None if self.few else self.leader


def recommend(settings: list[Setting], sweeps: dict[str, Sweep], runs: pd.DataFrame) -> list[Pick]:
    picks = []
    for i, s in enumerate(settings):
        if s.sweep not in sweeps:
            continue
        values = sweeps[s.sweep].values
        if s.among not in values or (s.over is not None and s.over not in values) or set(s.at or []) - set(
                values.get(s.over, [])):
            raise ClaimsError(f"recommend[{i}]: sweep {s.sweep!r} has no axis {s.among!r} or {s.over!r}, or at {s.at} "
                              f"is not on it; axes: {values}")
        mine = runs[runs.sweep == s.sweep]
        for v in [v for v in values[s.over] if s.at is None or v in s.at] if s.over else [None]:
            cells = select(mine, {s.over: v}) if s.over else mine
            planned = [p.labels[s.among] for p in sweeps[s.sweep].points() if s.over is None or p.labels[s.over] == v]
            if cells.usable.any():
                picks.append(pick(s.setting, f"{s.over} = {v}" if s.over else "", cells, s.among, planned))
    return picks


def pick(setting: str, at: str, runs: pd.DataFrame, among: str, planned: list[str] = ()) -> Pick:
    """The evidence at one setting; ``planned``: the grid's candidates there (those without runs are named)."""
    usable, everyone = runs[runs.usable][among].value_counts(), dict.fromkeys([*runs[among], *planned])
    names = [n for n in everyone if usable.get(n, 0) >= MIN_SEEDS]
    cells = {n: runs[runs[among] == n] for n in names}
    groups: list[list[str]] = []
    for n in names:
        same = next((g for g in groups if identical(cells[g[0]], cells[n])), None)
        same.append(n) if same is not None else groups.append([n])
    values = [pd.concat([by_seed(cells[n], METRIC) for n in g]).groupby(level=0).first() for g in groups]
    diffs = {(i, j): paired(values[i], values[j]) for i, j in itertools.permutations(range(len(groups)), 2)}
    tests = [(i, j) for i, j in diffs if i < j and diffs[(i, j)].diff.n >= 2]
    ahead = [(i, j) if diffs[(i, j)].diff.mean > 0 else (j, i) for (i, j), p in
             zip(tests, holm([p_value(diffs[t].values.to_numpy(), 0.0) for t in tests])) if p < FAMILY_ERROR]
    top = [i for i in range(len(groups)) if not any((k, i) in ahead for k in range(len(groups)))]
    out = Pick(setting, at, int(runs.updates.max()), groups, top, {k: diffs[k] for k in ahead},
               {n: (int(u.collapsed.sum()), len(u)) for n, u in ((n, c[c.usable]) for n, c in cells.items())
                if u.collapsed.any()}, settling={n: settling(cell)[1] for n, cell in cells.items()},
               few={n: int(usable.get(n, 0)) for n in everyone if n not in cells},
               values={n: by_seed(cells[n], METRIC) for n in names})
    if out.leader is not None:
        out.level = mean_ci(by_seed(cells[out.leader], METRIC))
    return out


def identical(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Whether two candidates' runs are identical on every seed both have (at least two)."""
    diffs = [paired(by_seed(a, m), by_seed(b, m)).values for m in IDENTICAL]
    return diffs[0].size >= 2 and all(d.size == diffs[0].size and (d == 0).all() for d in diffs)


def advice(p: Pick) -> str:
    """One line of the recommendation in words (page.md says how to read it)."""
    def names(i: int) -> str:
        return " = ".join(display_name(n) for n in p.groups[i])

    text = (p.at + ", " if p.at else "") + f"held-out sampled accuracy after {p.updates} updates: "
    if p.named is not None:
        text += f"use **{display_name(p.named)}** (held-out {ci_text(p.level)})"
    elif p.leader is not None:
        text += f"the evidence picks none yet; {display_name(p.leader)} is ahead of every loss with enough runs"
    elif sum(map(len, p.groups)) < 2:
        text += "the evidence picks none; " + (f"only {names(0)} ran" if p.groups else "no loss ran on two seeds")
    else:
        same = [names(i) for i in p.top if len(p.groups[i]) > 1]
        text += "the evidence picks none" + "".join(f"; identical updates: {s}" for s in same)
        tied = [names(i) for i in p.top if len(p.groups[i]) == 1]
        if tied:
            text += f"; {'tied with them' if same else 'tied'}: " + ", ".join(tied)
    for j in (j for j in range(len(p.groups)) if j not in p.top):  # behind a group, so ahead holds one (i, j)
        i = next(i for i in [*p.top, *range(len(p.groups))] if (i, j) in p.ahead)
        d, n = p.ahead[(i, j)], p.ahead[(i, j)].diff.n
        label = "robust" if n >= ROBUST_SEEDS and d.wins >= ROBUST_SHARE * n else "supported"
        text += f"; {names(j)} behind {names(i)} by {ci_text(d.diff, True)}, higher in {d.wins}/{n} seeds ({label})"
    if p.few:
        text += "; too few finished runs to compare: " + ", ".join(f"{display_name(n)} ({k})" for n, k in p.few.items())
    words = list(p.settling.values())
    if any(w != "–" for w in words):
        text += f"; curves at this budget: {words.count('settled')} of {len(words)} settled, " \
                f"{words.count('still rising')} still rising"
    if p.collapsed:
        text += "; collapsed runs: " + ", ".join(f"{display_name(n)} {k}/{m}" for n, (k, m) in p.collapsed.items())
    return text


def longer(p: Pick, q: Pick) -> str:
    """``p``'s line at ``q``'s longer budget (the same setting value, losses both ran): q's verdict, and each of p's
    leads among those losses paired on the seeds both budgets ran."""
    both = [n for g in p.groups for n in g if n in q.values]
    text = f"the same losses after {q.updates} updates ({q.setting}): " + advice(q).split(" updates: ", 1)[1]
    for (i, j), d in p.ahead.items():
        for a, b in ((a, b) for a in p.groups[i] for b in p.groups[j] if a in both and b in both):
            seeds = paired(q.values[a], q.values[b]).values.index
            short = paired(p.values[a], p.values[b]).values
            text += (f"; {display_name(a)} - {display_name(b)} on the {len(seeds)} seeds both budgets ran: "
                     f"{ci_text(mean_ci(short[short.index.isin(seeds)]), True)} after {p.updates} updates, "
                     f"{ci_text(paired(q.values[a], q.values[b]).diff, True)} after {q.updates}")
    return text


def recommendation_markdown(picks: list[Pick]) -> str:
    """The recommendation's lines, under their settings (page.md says how to read them); a line with a longer budget
    elsewhere (the same value of the setting's axis, at least two of its losses) shows that budget beneath it."""
    lines = []
    for setting in dict.fromkeys(p.setting for p in picks):
        lines += [f"**{setting[0].upper() + setting[1:]}**", ""]
        for p in (p for p in picks if p.setting == setting):
            lines += [f"- {advice(p)}", *(f"  - {longer(p, q)}" for q in picks if q.at and q.at == p.at
                                          and q.updates > p.updates and len(set(q.values) & set(p.values)) > 1)]
        lines += [""]
    return "\n".join(lines).rstrip("\n") or "No sweep of the recommendation's settings has run yet."
