"""The paper's claims, each a typed judge of the table of runs (vespo.lab.runs): ``claim.judge(runs)``.

A claims file (configs/lab/claims.yaml) lists claims; each names a sweep, one kind of evidence and
what the paper expects of it (`metric` defaults to eval_sampled; any of vespo.lab.runs.METRICS):

    compare:   {a: {kernel: asymmetric}, b: [{kernel: symmetric}]}     paired a - b over seeds, per b
    across:    {a: {loss: vespo}, b: [{loss: grpo}], over: N, at: ["8", "64"]}    the same at each N;
               with expect increasing | decreasing: each step of N (a - b, or a, at N minus at the previous N)
    level:     [{loss: vespo, N: "64"}]         a condition's own value over seeds (e.g. metric: eval_rise)
    collapses: {loss: sapo, N: "64"}            collapsed runs (vespo.lab.collapse); a "none" claim names a
               control: {sweep, where}, runs where the rule fires
    stabler:   {a: {loss: vespo}, b: [{loss: grpo}], over: lr}    collapses paired by seed and `over` value
    expect:    greater | less | {within: m} | {at_least: m} | report (measured, no verdict) |
               increasing | decreasing (across) | most | some | none (collapses) | greater (stabler)

A comparison's test is a t-test of the paired differences against the claim's line (0, or the margin;
the 90% interval shown excludes the line <=> p < 0.10), a stabler one McNemar's exact test; the page's
tests are one family under Holm (`decide`). Each verdict is also judged on held-out greedy accuracy and
on the mean of the last quarter's evaluations (READINGS); where they differ it depends on the metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from vespo.lab.grid import SEED_AXIS, Sweep, one_line, read_yaml
from vespo.lab.runs import METRICS, by_seed, select
from vespo.lab.stats import (FAMILY_ERROR, MIN_SEEDS, Interval, Paired, ci_text, exact_paired_p, holm, mean_ci, p_value,
                              paired, rate_ci)

AGREES, DISAGREES, UNRESOLVED, PARTLY, NOT_RUN, NO_VERDICT, TOO_FEW, DEPENDS = (
    "agrees", "disagrees", "not resolved", "partly", "not run", "—", "too few seeds", "depends on the metric")
ROBUST, SUPPORTED, UNCLEAR = "robust", "supported", "unclear"
ROBUST_SHARE, ROBUST_SEEDS = 0.9, 5  # robust: at least this share of at least this many seeds on its side
READINGS = {"eval_sampled": "held-out sampled", "eval_greedy": "greedy", "eval_last": "last-quarter mean"}
Where = dict[str, Any]


class ClaimsError(ValueError):
    """A claims file is malformed, or a claim selects cells its sweep does not have."""


def _text(where: Where) -> str:
    return ", ".join(f"{k}={v}" for k, v in where.items())


@dataclass
class Test:
    """One test a verdict rests on: its p-value against the claim's line and which side it falls on."""

    name: str
    text: str  # "+0.060 [+0.036, +0.083], 10 seeds, higher in 10"
    p: float  # raw, two-sided
    side: int  # +1: the claim's side of its line, -1: the other
    n: int  # seeds (or discordant pairs)
    share: float  # share of them on ``side``
    adjusted: float = math.nan  # Holm, over the page's family
    verdict: bool = True  # False for "report": measured, no verdict
    ci: Interval | None = None  # the mean difference with its interval (t-tests)

    @property
    def outcome(self) -> str:
        if self.n == 0:
            return NOT_RUN
        if self.n < MIN_SEEDS:
            return TOO_FEW
        if not self.verdict:
            return NO_VERDICT
        return (AGREES if self.side > 0 else DISAGREES) if self.adjusted < FAMILY_ERROR else UNRESOLVED


def paired_test(name: str, d: Paired, expect: str, margin: float = math.nan, count: str = "higher in") -> Test:
    """The t-test of a comparison against its claim's line: 0 (greater, less, report), the margin
    (at_least), or both -m and +m (within: inside both, or outside the nearer one)."""
    x, ci = d.values.to_numpy(dtype=float), d.diff
    text = "no common seeds" if not ci.n else ci_text(ci, signed=True) + ("" if ci.resolved else " (one seed)") + \
        f", {ci.n} seeds, {count} {d.wins}"
    if expect == "within":
        inside = abs(ci.mean) < margin
        p = max(p_value(x, -margin), p_value(x, margin)) if inside else p_value(x, math.copysign(margin, ci.mean))
        on = np.abs(x) < margin
        return Test(name, text, p, 1 if inside else -1, ci.n, float(np.mean(on if inside else ~on)) if ci.n else 0.0,
                    ci=ci)
    line = margin if expect == "at_least" else 0.0
    sign = -1 if expect in ("less", "decreasing") else 1
    side = sign * (1 if ci.mean > line else -1)
    share = float(np.mean(np.sign(x - line) == side * sign)) if ci.n else 0.0
    return Test(name, text, p_value(x, line), side, ci.n, share, verdict=expect != "report", ci=ci)


@dataclass
class Verdict:
    claim: Claim
    readings: dict[str, list[Test]] = field(default_factory=dict)  # metric -> tests, the claim's metric first
    text: str = ""  # what was measured, for claims without tests (collapses)
    verdict: str = ""  # set by the judge for collapse claims, by `decide` for the others
    robustness: str = ""


class Claim(BaseModel):
    model_config = ConfigDict(extra="forbid")
    EXPECT: ClassVar[tuple[str, ...]] = ("greater", "less", "within", "at_least", "report")
    paper: str
    sweep: str
    expect: str | dict[str, float]
    metric: str = "eval_sampled"
    where: str = ""  # "claims.yaml, claim 3" (set when loaded)

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v not in METRICS:
            raise ValueError(f"metric {v!r} unknown; choose one of {', '.join(METRICS)}")
        return v

    def model_post_init(self, _: Any) -> None:
        name = self.expect if isinstance(self.expect, str) else next(iter(self.expect), "")
        if name not in self.EXPECT or isinstance(self.expect, dict) != (name in ("within", "at_least")) or (
                isinstance(self.expect, dict) and (len(self.expect) != 1 or (name == "within" and self.margin <= 0))):
            raise ValueError(f"expect {self.expect!r} is not valid for {type(self).__name__.lower()}; choose one of "
                             + ", ".join(f"{{{e}: margin > 0}}" if e in ("within", "at_least") else e for e in self.EXPECT))

    @property
    def kind(self) -> str:
        return self.expect if isinstance(self.expect, str) else next(iter(self.expect))

    @property
    def margin(self) -> float:
        return math.nan if isinstance(self.expect, str) else float(next(iter(self.expect.values())))

    def sides(self) -> list[Where]:
        return []

    def readings(self) -> list[str]:
        return [self.metric, *(m for m in READINGS if m != self.metric)] if self.metric in READINGS else [self.metric]

    def judge(self, runs: pd.DataFrame) -> Verdict:
        mine = runs[runs.sweep == self.sweep]
        if mine.empty:
            return Verdict(self, text=f"sweep {self.sweep!r} not run", verdict=NOT_RUN)
        return Verdict(self, {m: self.tests(mine, m) for m in self.readings()})

    def tests(self, runs: pd.DataFrame, metric: str) -> list[Test]:
        raise NotImplementedError


class Compare(Claim):
    a: Where
    b: list[Where]

    def sides(self) -> list[Where]:
        return [self.a, *self.b]

    def pairs(self, runs: pd.DataFrame) -> list[tuple[str, Where, Where]]:
        return [(f"vs {_text({k: v for k, v in b.items() if str(self.a.get(k)) != str(v)})}", self.a, b) for b in self.b]

    def tests(self, runs: pd.DataFrame, metric: str) -> list[Test]:
        return [paired_test(name, paired(by_seed(select(runs, a), metric), by_seed(select(runs, b), metric)),
                            self.kind, self.margin) for name, a, b in self.pairs(runs)]


class Across(Compare):
    EXPECT: ClassVar[tuple[str, ...]] = Claim.EXPECT + ("increasing", "decreasing")
    b: list[Where] = []
    over: str
    at: list[str] | None = None

    def values(self, runs: pd.DataFrame) -> list[str]:
        present = [v for v in dict.fromkeys(runs[self.over]) if v in (self.at or [v])]
        return sorted(present, key=float) if self.kind in ("increasing", "decreasing") else present

    def pairs(self, runs: pd.DataFrame) -> list[tuple[str, Where, Where]]:
        out = []
        for b in self.b:
            name = _text({k: x for k, x in b.items() if str(self.a.get(k)) != str(x)})
            out += [(f"{self.over}={v}" + (f" vs {name}" if name else ""), {self.over: v, **self.a}, {self.over: v, **b})
                    for v in self.values(runs) if {self.over: v, **self.a} != {self.over: v, **b}]
        return out

    def tests(self, runs: pd.DataFrame, metric: str) -> list[Test]:
        if self.kind not in ("increasing", "decreasing"):
            return super().tests(runs, metric)
        series = {}  # value -> a - b (or a) per seed
        for v in self.values(runs):
            y = by_seed(select(runs, {self.over: v, **self.a}), metric)
            series[v] = paired(y, by_seed(select(runs, {self.over: v, **self.b[0]}), metric)).values if self.b else y
        steps = list(zip(series, list(series)[1:]))
        return [paired_test(f"{self.over}={hi} minus {self.over}={lo}", paired(series[hi], series[lo]), self.kind)
                for lo, hi in steps]


class Level(Claim):
    select: list[Where]

    def sides(self) -> list[Where]:
        return self.select

    def tests(self, runs: pd.DataFrame, metric: str) -> list[Test]:
        return [paired_test(_text(w), Paired(by_seed(select(runs, w), metric).dropna()), self.kind, self.margin,
                            "above 0 in") for w in self.select]


class Stabler(Claim):
    EXPECT: ClassVar[tuple[str, ...]] = ("greater",)
    a: Where
    b: list[Where]
    over: str = "lr"

    def sides(self) -> list[Where]:
        return [self.a, *self.b]

    def readings(self) -> list[str]:
        return ["collapsed"]

    def tests(self, runs: pd.DataFrame, metric: str) -> list[Test]:
        key = [SEED_AXIS, self.over]
        a = select(runs[runs.usable], self.a).set_index(key)["collapsed"]
        out = []
        for b in self.b:
            both = pd.concat([a, select(runs[runs.usable], b).set_index(key)["collapsed"]], axis=1, join="inner")
            only_a, only_b = int((both.iloc[:, 0] & ~both.iloc[:, 1]).sum()), int((~both.iloc[:, 0] & both.iloc[:, 1]).sum())
            name = _text({k: v for k, v in b.items() if str(self.a.get(k)) != str(v)})
            text = (f"{len(both)} runs paired by seed and {self.over}: collapsed where the other did not "
                    f"{only_a} vs {only_b}")
            out.append(Test(f"vs {name}", text, exact_paired_p(only_a, only_b), 1 if only_b > only_a else -1, len(both),
                            max(only_a, only_b) / max(1, only_a + only_b)))
        return out


class Collapses(Claim):
    EXPECT: ClassVar[tuple[str, ...]] = ("most", "some", "none")
    select: Where
    control: dict | None = None  # {sweep, where}: runs where the rule fires

    def model_post_init(self, _: Any) -> None:
        super().model_post_init(_)
        if self.control is not None and (set(self.control) != {"sweep", "where"} or not isinstance(self.control["where"], dict)):
            raise ValueError("control must be {sweep: NAME, where: {axis: value}}")
        if self.kind == "none" and self.control is None:
            raise ValueError("a 'none' collapse claim needs a control: {sweep, where} selecting runs where the rule "
                             "fires (otherwise 'no collapse' says nothing about the loss)")

    def sides(self) -> list[Where]:
        return [self.select]

    def judge(self, runs: pd.DataFrame) -> Verdict:
        mine = select(runs[(runs.sweep == self.sweep) & runs.usable], self.select)
        if mine.empty:
            return Verdict(self, text="no finished runs" if (runs.sweep == self.sweep).any() else
                           f"sweep {self.sweep!r} not run", verdict=NOT_RUN)
        dead, text = int(mine.collapsed.sum()), collapse_text(mine)
        if self.kind == "none":
            verdict = AGREES if dead == 0 else DISAGREES
        elif self.kind == "some":  # none collapsing does not show "can collapse", nor refute it
            verdict = AGREES if dead else UNRESOLVED
        elif dead == 0 and rate_ci(0, len(mine)).high >= 0.5:  # too few runs to rule out "most"
            verdict = TOO_FEW
        else:
            verdict = AGREES if 2 * dead >= len(mine) else DISAGREES if dead == 0 else PARTLY
        if self.control is not None:
            control = select(runs[(runs.sweep == self.control["sweep"]) & runs.usable], self.control["where"])
            name = f"{self.control['sweep']} {_text(self.control['where'])}"
            if control.empty:
                return Verdict(self, text=f"{text}; control ({name}) not run: the rule was not seen to fire",
                               verdict=UNRESOLVED)
            text += f"; control ({name}): {collapse_text(control)}"
            if not control.collapsed.any() and verdict == AGREES:
                return Verdict(self, text=text + ": the rule fired in no control run, so 'no collapse' says nothing",
                               verdict=UNRESOLVED)
        return Verdict(self, text=text, verdict=verdict)


def collapse_text(runs: pd.DataFrame) -> str:
    """"2/10 runs collapsed (reward 2), rate 0.20 [0.04, 0.51]"."""
    reasons = runs[runs.collapsed].reason.value_counts().sort_index()
    rate = rate_ci(int(runs.collapsed.sum()), len(runs))
    return (f"{int(runs.collapsed.sum())}/{len(runs)} runs collapsed"
            + (" (" + ", ".join(f"{k} {v}" for k, v in reasons.items()) + ")" if len(reasons) else "")
            + f", rate {rate.mean:.2f} [{rate.low:.2f}, {rate.high:.2f}]")


SETTLED_BAND = 0.02  # curves have settled where the last quarter's rise lies within +-this (about one evaluation's SD)


def settling(runs: pd.DataFrame) -> tuple[Interval, str]:
    """The mean held-out evaluation of a condition's last quarter minus the quarter before, and what it says."""
    ci = mean_ci(by_seed(runs, "eval_rise"))
    if not ci.resolved:
        return ci, "–"
    return ci, ("settled" if -SETTLED_BAND < ci.low and ci.high < SETTLED_BAND else "still rising" if ci.low > 0
                else "falling" if ci.high < 0 else "not shown to settle")


KINDS: dict[str, type[Claim]] = {"compare": Compare, "across": Across, "level": Level, "stabler": Stabler,
                                 "collapses": Collapses}


# ---------------------------------------------------------------- the file


@dataclass
class Claims:
    claims: list[Claim]
    headline: str | None = None  # the sweep whose headline figure leads the results page
    recommend: list[dict] = field(default_factory=list)  # settings for the recommendation (vespo.lab.recommend)
    together: list[list[int]] = field(default_factory=list)  # claims (1-based) read side by side
    source: str = ""


def load_claims(path: str | Path) -> Claims:
    path = Path(path)
    data = read_yaml(path, ClaimsError) or {}
    if not isinstance(data, dict) or not isinstance(data.get("claims"), list):
        raise ClaimsError(f"{path}: expected a mapping with a 'claims' list")
    unknown = set(data) - {"claims", "headline", "recommend", "read_together"}
    if unknown:
        raise ClaimsError(f"{path}: unknown key(s) {sorted(unknown)}; valid: claims, headline, recommend, read_together")
    claims = [parse_claim(c, f"{path.name}, claim {i + 1}") for i, c in enumerate(data["claims"])]
    together = data.get("read_together") or []
    if not all(isinstance(t, list) and all(isinstance(i, int) and 1 <= i <= len(claims) for i in t) for t in together):
        raise ClaimsError(f"{path}: read_together must be lists of claim numbers 1..{len(claims)}")
    return Claims(claims, data.get("headline"), data.get("recommend") or [], together, str(path))


def parse_claim(entry: Any, where: str) -> Claim:
    if not isinstance(entry, dict):
        raise ClaimsError(f"{where}: must be a mapping, got {entry!r}")
    kinds = [k for k in KINDS if k in entry]
    if len(kinds) != 1:
        raise ClaimsError(f"{where}: give exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
    body = entry[kinds[0]]
    if kinds[0] in ("compare", "across", "stabler"):
        if not isinstance(body, dict):
            raise ClaimsError(f"{where}: {kinds[0]} must be a mapping {{a: ..., b: ...}}")
        body = {**body, **({"b": body["b"] if isinstance(body["b"], list) else [body["b"]]} if "b" in body else {})}
    else:
        body = {"select": body if kinds[0] == "collapses" or isinstance(body, list) else [body]}
    try:
        return KINDS[kinds[0]].model_validate({**{k: v for k, v in entry.items() if k != kinds[0]}, **body,
                                               "where": where})
    except ValidationError as e:
        raise ClaimsError(f"{where}: {kinds[0]}: {one_line(e)}") from None


def check_claims(claims: Claims, sweeps: dict[str, Sweep], strict: bool = True) -> None:
    """Check every claim against its sweep's grid before anything is judged: the sweep exists (unless
    not ``strict``: then a claim of a sweep not given is left to say "not run"), the selections use its
    axes and values, a comparison names one condition (every axis but the seed and `over` fixed)."""
    if strict and claims.headline is not None and claims.headline not in sweeps:
        raise ClaimsError(f"{claims.source}: headline sweep {claims.headline!r} is not one of {sorted(sweeps)}")
    for c in claims.claims:
        if c.sweep not in sweeps:
            if not strict:
                continue
            raise ClaimsError(f"{c.where}: no sweep named {c.sweep!r}; sweeps: {sorted(sweeps)}")
        values, over = sweeps[c.sweep].values, getattr(c, "over", None)
        try:
            if over is not None and over not in values:
                raise ValueError(f"{over!r} is not an axis of sweep {c.sweep!r}; axes: {list(values)}")
            if isinstance(c, Across) and c.kind in ("increasing", "decreasing"):
                [math.log2(float(v)) for v in values[over]]
            for side in c.sides():
                check_where(values, side)
                free = [a for a in values if a not in (SEED_AXIS, over) and len(values[a]) > 1 and a not in side]
                if free and not isinstance(c, Collapses):
                    raise ValueError(f"{side} leaves the axis/axes {free} open; a comparison names one condition")
            if isinstance(c, Collapses) and c.control is not None and (strict or c.control["sweep"] in sweeps):
                if c.control["sweep"] not in sweeps:
                    raise ValueError(f"control sweep {c.control['sweep']!r} is not one of {sorted(sweeps)}")
                check_where(sweeps[c.control["sweep"]].values, c.control["where"])
        except ValueError as e:
            raise ClaimsError(f"{c.where}: sweep {c.sweep!r}: {e}") from None


def check_where(values: dict[str, list[str]], where: Where) -> None:
    for axis, v in where.items():
        if axis not in values:
            raise ValueError(f"no axis {axis!r}; axes: {list(values)}")
        bad = [str(x) for x in (v if isinstance(v, list) else [v]) if str(x) not in values[axis]]
        if bad:
            raise ValueError(f"{axis}={bad} not in the grid's values {values[axis]}")


# ---------------------------------------------------------------- the verdicts


def evaluate(claims: Claims, sweeps: dict[str, Sweep], runs: pd.DataFrame) -> list[Verdict]:
    """Every claim judged, then decided together (`decide`)."""
    check_claims(claims, sweeps, strict=False)
    return decide([c.judge(runs) for c in claims.claims])


def decide(verdicts: list[Verdict]) -> list[Verdict]:
    """Holm over the tests of every verdict, one family per reading (the claims' own metrics, greedy,
    last-quarter mean); then each claim's verdict on each reading, and the claim's verdict."""
    families: dict[int, list[Test]] = {}
    for v in verdicts:
        for i, tests in enumerate(v.readings.values()):
            families.setdefault(i, []).extend(t for t in tests if t.verdict and t.n >= MIN_SEEDS)
    for tests in families.values():
        for t, p in zip(tests, holm([t.p for t in tests])):
            t.adjusted = p
    for v in verdicts:
        if not v.readings:
            continue
        by = {m: combine([t.outcome for t in tests]) for m, tests in v.readings.items()}
        first = next(iter(by.values()))
        v.verdict = first if len(set(by.values())) == 1 or first == NO_VERDICT else DEPENDS
        v.robustness = robustness(v)
    return verdicts


def combine(outcomes: list[str]) -> str:
    """One verdict for a claim made of several tests: agrees only if all do; any disagreement disagrees."""
    if not outcomes or all(o == NO_VERDICT for o in outcomes):
        return NO_VERDICT
    for verdict, rule in ((NOT_RUN, all), (DISAGREES, any), (AGREES, all)):
        if rule(o == verdict for o in outcomes):
            return verdict
    return TOO_FEW if TOO_FEW in outcomes and UNRESOLVED not in outcomes else UNRESOLVED


def robustness(v: Verdict) -> str:
    """robust: resolved on every reading, by at least ROBUST_SHARE of at least ROBUST_SEEDS seeds on its
    side in each test that decides it; supported: resolved on every reading; unclear: not resolved."""
    tests = next(iter(v.readings.values()))
    if v.verdict == NO_VERDICT or not tests:
        return ""
    if any(t.outcome == TOO_FEW for t in tests):
        return TOO_FEW
    if v.verdict not in (AGREES, DISAGREES):
        return UNCLEAR
    deciding = [t for t in tests if t.outcome == v.verdict]
    return ROBUST if all(t.n >= ROBUST_SEEDS and t.share >= ROBUST_SHARE for t in deciding) else SUPPORTED


def measured(v: Verdict) -> str:
    """What a verdict rests on, in words: each test with its Holm-adjusted p, and the readings that differ."""
    if not v.readings:
        return v.text
    (metric, tests), *others = v.readings.items()
    head = "collapses" if metric == "collapsed" else f"{metric} difference" if not isinstance(v.claim, Level) else metric
    parts = [f"{t.name}: {t.text}" + (f" (Holm p {t.adjusted:.3f})" if math.isfinite(t.adjusted) else "")
             for t in tests]
    text = f"{head}: " + "; ".join(parts)
    if v.verdict == DEPENDS:
        by = {m: combine([t.outcome for t in ts]) for m, ts in v.readings.items()}
        text += f"; {by[metric]} on {READINGS[metric]}, but " + "; ".join(
            f"{by[m]} on {READINGS[m]} (" + "; ".join(f"{t.name} {ci_text(t.ci, signed=True)}" for t in ts) + ")"
            for m, ts in others if by[m] != by[metric])
    return text


def together_text(verdicts: list[Verdict], numbers: list[int], runs: pd.DataFrame) -> str:
    """Claims that make the same comparison at different budgets (optimizer steps), read side by side."""
    vs = [verdicts[i - 1] for i in numbers]
    budget = {v.claim.sweep: int(runs[runs.sweep == v.claim.sweep].updates.max()) for v in vs
              if (runs.sweep == v.claim.sweep).any()}
    tests = {(i, t.name): (v, t) for i, v in zip(numbers, vs) for t in next(iter(v.readings.values()), [])}
    lines = []
    for name in dict.fromkeys(n for _, n in tests):
        seen = [(i, *tests[(i, name)]) for i in numbers if (i, name) in tests]
        if len(seen) < 2 or any(v.claim.sweep not in budget for _, v, _ in seen):
            continue
        seen.sort(key=lambda x: budget[x[1].claim.sweep])
        lines.append(f"{name}: " + "; ".join(f"after {budget[v.claim.sweep]} updates {t.text} (claim {i}: {v.verdict})"
                                            for i, v, t in seen) + ".")
        (_, v1, t1), (_, v2, t2) = seen[0], seen[-1]
        if t1.ci and t2.ci and t1.ci.resolved and t2.ci.resolved:
            has0 = [ci.low <= 0 <= ci.high for ci in (t1.ci, t2.ci)]
            apart = t1.ci.high < t2.ci.low or t2.ci.high < t1.ci.low or has0[0] != has0[1]
            lines.append(f"So it lies between {t1.ci.low:+.3f} and {t1.ci.high:+.3f} after {budget[v1.claim.sweep]} "
                         f"updates and between {t2.ci.low:+.3f} and {t2.ci.high:+.3f} after {budget[v2.claim.sweep]}"
                         + (": what the shorter runs measure does not hold for the longer ones." if apart else
                            ": the two budgets agree within their intervals."))
    if not lines:
        return ""
    return f"**Claims {', '.join(map(str, numbers))} read together** (the same comparison at different budgets): " + \
        " ".join(lines)
