"""The recommendation at the top of the results page: which loss to use where, from the sweeps.

The claims file names the settings to recommend for:

    recommend:
      - {setting: "synchronous training, N updates per rollout batch", sweep: staleness, among: loss, over: N}
      - {setting: "fully asynchronous training", sweep: async, among: loss}
      - {setting: "4x as long", sweep: endpoint, among: loss, over: N, at: ["64"]}

At each value of `over` (or only at the values `at` lists; once, without `over`) the candidates (the values of `among`) are ranked by
their mean held-out accuracy after training. The first is compared with every other, paired by
seed: a candidate whose difference from the first has an interval wholly above 0 is behind it,
with the robustness label of vespo.lab.claims; any other is tied with it. Candidates with collapsed
runs say so. `scale_limits` is what a tiny model on a toy task cannot say, whatever the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vespo.lab.claims import ClaimsError, Sweeps, robustness
from vespo.lab.results import RunResult, by_seed, group, select
from vespo.lab.stats import CONFIDENCE, Interval, Paired, mean_ci, paired_difference
from vespo.plot import display_name

METRIC = "eval_sampled"
SCALE_LIMITS = (
    "The lab's policy is a 2-layer, 128-wide model trained on reversing 16 letters (17-token answers) with "
    "exact-match rewards, on CPU. What ranks losses here need not rank them for a large model on long reasoning "
    "answers, where sequence weights span thousands of tokens and the learning rate, batch and clipping are tuned "
    "for that model; differences of a few points here say which losses are worth trying first, not which wins at "
    "scale. Engine mismatch here is simulated with a bf16 copy of the same weights, not an inference engine's "
    "kernels, and async timing comes from two CPU processes, not a cluster.")


@dataclass
class Behind:
    name: str
    diff: Paired  # first minus this one, seed by seed
    label: str  # robustness of the difference


@dataclass
class Pick:
    setting: str
    at: str  # "N = 64", or "" without an `over` axis
    first: str  # the candidate with the best mean
    level: Interval  # its held-out accuracy
    tied: list[tuple[str, Paired]] = field(default_factory=list)
    behind: list[Behind] = field(default_factory=list)
    collapsed: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (collapsed, usable runs)


def recommend(entries: list[dict], sweeps: Sweeps) -> list[Pick]:
    picks = []
    for i, entry in enumerate(entries):
        setting, sweep, among, over, at = _entry(entry, i)
        if sweep not in sweeps:
            continue
        record, results = sweeps[sweep]
        axes = {a["label"]: a["values"] for a in record["axes"]}
        if among not in axes or (over is not None and over not in axes):
            raise ClaimsError(f"recommend[{i}]: sweep {sweep!r} has no axis {among!r}" + (f" or {over!r}" if over else "")
                              + f"; axes: {list(axes)}")
        if at is not None and (over is None or set(at) - set(axes[over])):
            raise ClaimsError(f"recommend[{i}]: at {at} must be values of its 'over' axis"
                              + (f" {over!r}: {axes[over]}" if over else " (it has none)"))
        for value in ([v for v in axes[over] if at is None or v in at] if over else [None]):
            runs = select(record, results, {over: value}) if over else results
            pick = pick_one(setting, f"{over} = {value}" if over else "", group(runs, [among]))
            if pick is not None:
                picks.append(pick)
    return picks


def _entry(entry: dict, i: int) -> tuple[str, str, str, str | None, list[str] | None]:
    unknown = set(entry) - {"setting", "sweep", "among", "over", "at"}
    if unknown or not {"setting", "sweep", "among"} <= set(entry):
        raise ClaimsError(f"recommend[{i}]: expected {{setting, sweep, among, over (optional), at (optional)}}, "
                          f"got {entry}")
    at = entry.get("at")
    if at is not None and not (isinstance(at, list) and at):
        raise ClaimsError(f"recommend[{i}]: at must be a list of values of the 'over' axis, got {at!r}")
    return (str(entry["setting"]), str(entry["sweep"]), str(entry["among"]), entry.get("over"),
            None if at is None else [str(v) for v in at])


def pick_one(setting: str, at: str, cells: dict[tuple, list[RunResult]]) -> Pick | None:
    """Rank the candidates of one setting and compare the first with the rest."""
    levels = {key[0]: mean_ci(list(by_seed(runs, METRIC).values())) for key, runs in cells.items()}
    ranked = sorted((k for k in levels if math.isfinite(levels[k].mean)), key=lambda k: -levels[k].mean)
    if not ranked:
        return None
    first = ranked[0]
    pick = Pick(setting, at, first, levels[first])
    for name in ranked[1:]:
        p = paired_difference(by_seed(cells[(first,)], METRIC), by_seed(cells[(name,)], METRIC))
        if p.diff.resolved and p.diff.low > 0:
            pick.behind.append(Behind(name, p, robustness(p)))
        else:
            pick.tied.append((name, p))
    for (name,), runs in cells.items():
        usable = [r for r in runs if r.usable]
        dead = sum(r.collapse.collapsed for r in usable)
        if dead:
            pick.collapsed[name] = (dead, len(usable))
    return pick


# ---------------------------------------------------------------- in words


def recommendation_markdown(picks: list[Pick]) -> str:
    """The page's first section: per setting and staleness, what to use, and what this evidence is worth."""
    if not picks:
        return "No sweep of the recommendation's settings has run yet."
    level = f"{CONFIDENCE:.0%}"
    lines = []
    for setting in dict.fromkeys(p.setting for p in picks):
        lines += [f"**{setting[0].upper() + setting[1:]}**", ""]
        for p in (x for x in picks if x.setting == setting):
            lines.append(f"- {p.at + ': ' if p.at else ''}{_advice(p)}")
        lines.append("")
    lines += [f"Each difference is the first loss minus the other, paired by seed, with its {level} interval and how "
              "many seeds it is higher in; *robust* / *supported* as in the claims below. \"Tied\" means the interval "
              "holds 0: these seeds cannot tell the losses apart, not that they are equal.", "",
              f"What this scale cannot say: {SCALE_LIMITS}"]
    return "\n".join(lines)


def _advice(p: Pick) -> str:
    first = display_name(p.first)
    tied = [display_name(n) for n, _ in p.tied]
    head = (f"use **{first}** (held-out {_level(p.level)})" if not tied else
            f"**{first}** (held-out {_level(p.level)}) or any loss tied with it: {', '.join(tied)}")
    parts = [head]
    if p.behind:
        parts.append("ahead of " + "; ".join(f"{display_name(b.name)} by {_diff(b.diff)} ({b.label})" for b in p.behind))
    if p.collapsed:
        parts.append("collapsed runs: " + ", ".join(f"{display_name(n)} {k}/{m}" for n, (k, m) in p.collapsed.items()))
    return "; ".join(parts)


def _level(ci: Interval) -> str:
    return f"{ci.mean:.3f}" + (f" [{ci.low:.3f}, {ci.high:.3f}]" if ci.resolved else "")


def _diff(p: Paired) -> str:
    d = p.diff
    return f"{d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}], higher in {p.wins}/{d.n} seeds"
