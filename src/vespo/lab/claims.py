"""The paper's claims, each a typed judge of the table of runs: ``claim.judge(runs) -> Verdict``.

configs/lab/claims.yaml lists them; each names a sweep, one kind of evidence (KINDS; docs/lab.md, Claims)
and what the paper expects. A comparison is a t-test of paired differences against the claim's line; a
"stabler" one is McNemar's exact test. `decide` corrects every test of the page together (Holm) and reads
each verdict on three metrics (READINGS): where a reading lies on the other side of the claim's line, it depends
on the metric; where the readings only differ in what resolves, the verdict says on which it holds ("agrees on
greedy only"). A "none" collapse claim with no collapse gives an upper bound on the rate, not agreement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, BeforeValidator, ConfigDict, PositiveInt, ValidationError

from vespo.config import load_yaml
from vespo.lab.collapse import REASONS
from vespo.lab.grid import SEED_AXIS, Sweep, off_grid, one_line
from vespo.lab.runs import METRICS, by_seed, select
from vespo.lab.stats import CONFIDENCE, FAMILY_ERROR, MIN_SEEDS, Interval, Paired, ci_text, exact_paired_p, holm, \
    mean_ci, p_value, paired, rate_ci

AGREES, DISAGREES, UNRESOLVED, PARTLY, NOT_RUN, NO_VERDICT, TOO_FEW, DEPENDS = (
    "agrees", "disagrees", "not resolved", "partly", "not run", "—", "too few seeds", "depends on the metric")
ROBUST, SUPPORTED, UNCLEAR = "robust", "supported", "unclear"
BOUNDED = "rate at most"  # a "none" collapse claim without a collapse: "rate at most 0.14" (one-sided bound)
ROBUST_SHARE, ROBUST_SEEDS = 0.9, 5  # robust: at least this share of at least this many seeds on its side
READINGS = {"eval_sampled": "held-out sampled", "eval_greedy": "greedy", "eval_last": "last-quarter mean"}
SETTLED_BAND = 0.02  # curves have settled where the last quarter's rise lies within +-this (about one evaluation's SD)
Where = dict[str, Any]
Wheres = Annotated[list[Where], BeforeValidator(lambda v: v if isinstance(v, list) else [v])]


class ClaimsError(ValueError):
    """A claims file is malformed, or a claim selects cells its sweep does not have."""


def _text(where: Where, a: Where | None = None) -> str:
    return ", ".join(f"{k}={v}" for k, v in where.items() if a is None or str(a.get(k)) != str(v))


@dataclass
class Test:
    """One test a verdict rests on: its p-value against the claim's line and which side it falls on."""

    name: str
    text: str  # "+0.060 [+0.036, +0.083], 10 seeds, higher in 10"
    p: float  # raw, two-sided
    side: int  # +1: the claim's side of its line, -1: the other, 0: on it
    n: int  # seeds (or paired runs)
    share: float  # share of seeds (or discordant pairs) on ``side``
    adjusted: float = math.nan  # Holm, over the page's family
    verdict: bool = True  # False for "report": measured, no verdict
    ci: Interval | None = None  # the mean difference with its interval (t-tests)
    values: pd.Series | None = None  # the paired difference on each seed (index: seed; t-tests)
    collapsed: int = 0  # collapsed runs among those it compares (where a t-test's coverage fails)

    @property
    def outcome(self) -> str:
        if self.n < MIN_SEEDS or not self.verdict:
            return (TOO_FEW if self.n else NOT_RUN) if self.n < MIN_SEEDS else NO_VERDICT
        return (AGREES if self.side > 0 else DISAGREES) if self.adjusted < FAMILY_ERROR else UNRESOLVED


def paired_test(name: str, d: Paired, expect: str, margin: float = math.nan) -> Test:
    """The t-test of a comparison against its claim's line: 0 (greater, less, report), the margin
    (at_least), or both -m and +m (within: inside both, or outside the nearer one)."""
    x, ci = d.values.to_numpy(dtype=float), d.diff
    text = "no common seeds" if not ci.n else \
        f"{ci_text(ci, signed=True)}" + (f", {ci.n} seeds" if ci.resolved else " (one seed)") + f", higher in {d.wins}"
    if expect == "within":
        inside, on = abs(ci.mean) < margin, np.abs(x) < margin
        p = max(p_value(x, -margin), p_value(x, margin)) if inside else p_value(x, math.copysign(margin, ci.mean))
        share = float(np.mean(on if inside else ~on)) if ci.n else 0
        return Test(name, text, p, 1 if inside else -1, ci.n, share, ci=ci, values=d.values)
    line, sign = (margin if expect == "at_least" else 0.0), (-1 if expect in ("less", "decreasing") else 1)
    side = sign * (1 if ci.mean > line else -1 if ci.mean < line else 0)  # 0: on the line (or no seeds)
    share = float(np.mean(np.sign(x - line) == side * sign)) if ci.n else 0.0
    return Test(name, text, p_value(x, line), side, ci.n, share, verdict=expect != "report", ci=ci, values=d.values)


def with_collapsed(test: Test, *cells: pd.DataFrame) -> Test:
    """``test`` with the number of collapsed runs, on the seeds it pairs, of the conditions it compares."""
    seeds = set(test.values.index) if test.values is not None else set()
    test.collapsed = sum(int(c[c.usable & c[SEED_AXIS].isin(seeds)].collapsed.sum()) for c in cells)
    return test


@dataclass
class Verdict:
    claim: Claim
    readings: dict[str, list[Test]] = field(default_factory=dict)  # metric -> tests, the claim's metric first
    text: str = ""  # what was measured, for claims without tests (collapses)
    verdict: str = ""  # set by the judge for collapse claims, by `decide` for the others

    @property
    def robustness(self) -> str:
        """robust: resolved on every reading, by at least ROBUST_SHARE of at least ROBUST_SEEDS seeds on its
        side in each test that decides it; supported: resolved on every reading; unclear: not resolved."""
        tests = next(iter(self.readings.values()), [])
        if self.verdict == NO_VERDICT or not tests:
            return ""
        if any(t.outcome == TOO_FEW for t in tests) or self.verdict not in (AGREES, DISAGREES):
            return TOO_FEW if any(t.outcome == TOO_FEW for t in tests) else UNCLEAR
        deciding = [t for t in tests if t.outcome == self.verdict]
        return ROBUST if all(t.n >= ROBUST_SEEDS and t.share >= ROBUST_SHARE for t in deciding) else SUPPORTED


class Claim(BaseModel):
    model_config = ConfigDict(extra="forbid")
    EXPECT: ClassVar[tuple[str, ...]] = ("greater", "less", "within", "at_least", "report")
    paper: str
    sweep: str
    expect: str | dict[str, float]
    metric: Literal[tuple(METRICS)] = "eval_sampled"
    where: str = ""  # "claims.yaml, claim 3" (set when loaded)

    def model_post_init(self, _: Any) -> None:
        margin = isinstance(self.expect, dict)
        if self.kind not in self.EXPECT or margin != (self.kind in ("within", "at_least")) or (
                margin and (len(self.expect) != 1 or (self.kind == "within" and self.margin <= 0))):
            choices = (f"{{{e}: margin > 0}}" if e in ("within", "at_least") else e for e in self.EXPECT)
            raise ValueError(f"expect {self.expect!r} is not valid for {type(self).__name__.lower()}; choose one of "
                             + ", ".join(choices))

    kind = property(lambda self: self.expect if isinstance(self.expect, str) else next(iter(self.expect), ""))
    margin = property(lambda self: math.nan if isinstance(self.expect, str) else float(*self.expect.values()))

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
    """a - b over seeds, for each b."""

    a: Where
    b: Wheres

    def pairs(self, runs: pd.DataFrame) -> list[tuple[str, Where, Where]]:
        return [(f"vs {_text(b, self.a)}", self.a, b) for b in self.b]

    def tests(self, runs: pd.DataFrame, metric: str) -> list[Test]:
        out = []
        for name, a, b in self.pairs(runs):
            x, y = select(runs, a), select(runs, b)
            d = paired(by_seed(x, metric), by_seed(y, metric))
            out.append(with_collapsed(paired_test(name, d, self.kind, self.margin), x, y))
        return out


class Across(Compare):
    """a - b at each value of `over` (or those in `at`); increasing | decreasing: each step of `over`."""

    EXPECT: ClassVar[tuple[str, ...]] = Claim.EXPECT + ("increasing", "decreasing")
    b: Wheres = []
    over: str
    at: list[str] | None = None

    def values(self, runs: pd.DataFrame) -> list[str]:
        present = [v for v in dict.fromkeys(runs[self.over]) if v in (self.at or [v])]
        return sorted(present, key=float) if self.kind in ("increasing", "decreasing") else present

    def pairs(self, runs: pd.DataFrame) -> list[tuple[str, Where, Where]]:
        return [(f"{self.over}={v}" + (f" vs {_text(b, self.a)}" if _text(b, self.a) else ""), {self.over: v, **self.a},
                 {self.over: v, **b}) for b in self.b for v in self.values(runs)
                if {self.over: v, **self.a} != {self.over: v, **b}]

    def tests(self, runs: pd.DataFrame, metric: str) -> list[Test]:
        if self.kind not in ("increasing", "decreasing"):
            return super().tests(runs, metric)
        series, cells = {}, {}  # value -> a - b (or a) per seed; its runs
        for v in self.values(runs):
            cells[v] = [select(runs, {self.over: v, **w}) for w in [self.a, *self.b[:1]]]
            y = by_seed(cells[v][0], metric)
            series[v] = paired(y, by_seed(cells[v][1], metric)).values if self.b else y
        return [with_collapsed(paired_test(f"{self.over}={hi} minus {self.over}={lo}", paired(series[hi], series[lo]),
                                           self.kind), *cells[lo], *cells[hi])
                for lo, hi in zip(series, list(series)[1:])]


class Stabler(Compare):
    """a collapses less than each b, runs paired by seed and `over` value (McNemar's exact test)."""

    EXPECT: ClassVar[tuple[str, ...]] = ("greater",)
    over: str = "lr"

    def readings(self) -> list[str]:
        return ["collapsed"]

    def tests(self, runs: pd.DataFrame, metric: str) -> list[Test]:
        def collapsed(where: Where) -> pd.Series:
            return select(runs[runs.usable], where).set_index([SEED_AXIS, self.over])["collapsed"]

        out = []
        for name, a, b in self.pairs(runs):
            x, y = pd.concat([collapsed(a), collapsed(b)], axis=1, join="inner").T.to_numpy(dtype=bool)
            only_a, only_b = int((x & ~y).sum()), int((~x & y).sum())
            text = f"{len(x)} runs paired by seed and {self.over}: collapsed where the other did not {only_a} vs " \
                f"{only_b}"
            out.append(Test(name, text, exact_paired_p(only_a, only_b), 1 if only_b > only_a else -1, len(x),
                            max(only_a, only_b) / max(1, only_a + only_b)))
        return out


class Control(BaseModel):
    """Runs where the collapse rule fires, beside a "no collapse" claim."""

    model_config = ConfigDict(extra="forbid")
    sweep: str
    where: Where


class Collapses(Claim):
    """Collapsed runs: most (at least half), some (at least one), none (beside a control where the rule fires; with
    no collapse the verdict is the rate's one-sided upper bound: zero events cannot show a zero rate)."""

    EXPECT: ClassVar[tuple[str, ...]] = ("most", "some", "none")
    select: Where
    control: Control | None = None

    def model_post_init(self, _: Any) -> None:
        super().model_post_init(_)
        if self.kind == "none" and self.control is None:
            raise ValueError("a 'none' collapse claim needs a control: {sweep, where} selecting runs where the rule "
                             "fires (otherwise 'no collapse' says nothing about the loss)")

    def judge(self, runs: pd.DataFrame) -> Verdict:
        mine = select(runs[(runs.sweep == self.sweep) & runs.usable], self.select)
        if mine.empty:
            return Verdict(self, text=f"sweep {self.sweep!r} not run", verdict=NOT_RUN)
        dead, text = int(mine.collapsed.sum()), collapse_text(mine)
        bound = rate_ci(0, len(mine)).high  # the two-sided interval's upper end: a one-sided bound at (1 + level) / 2
        if self.kind == "none" and dead == 0:
            text += f"; no collapse bounds the rate: at most {bound:.2f} (one-sided {(1 + CONFIDENCE) / 2:.0%}, exact)"
        verdict = {"none": f"{BOUNDED} {bound:.2f}" if dead == 0 else DISAGREES,
                   "some": AGREES if dead else UNRESOLVED}.get(
            self.kind) or (TOO_FEW if dead == 0 and rate_ci(0, len(mine)).high >= 0.5 else  # too few to rule out "most"
                           AGREES if 2 * dead >= len(mine) else DISAGREES if dead == 0 else PARTLY)
        if (c := self.control) is not None:
            control, name = select(runs[(runs.sweep == c.sweep) & runs.usable], c.where), f"{c.sweep} {_text(c.where)}"
            text += f"; control ({name})" + (f": {collapse_text(control)}" if len(control) else
                                             " not run: the rule was not seen to fire")
            if control.empty or (not control.collapsed.any() and verdict.startswith(BOUNDED)):
                text += "" if control.empty else ": the rule fired in no control run, so 'no collapse' says nothing"
                verdict = UNRESOLVED
        return Verdict(self, text=text, verdict=verdict)


def collapse_text(runs: pd.DataFrame) -> str:
    """"2/10 runs collapsed (fell 2), rate 0.20 [0.04, 0.51]"."""
    dead, reasons = int(runs.collapsed.sum()), runs[runs.collapsed].reason.value_counts().sort_index()
    why = " (" + ", ".join(f"{REASONS[k]} {v}" for k, v in reasons.items()) + ")" if dead else ""
    return f"{dead}/{len(runs)} runs collapsed{why}, rate {ci_text(rate_ci(dead, len(runs)), digits=2)}"


def settling(runs: pd.DataFrame) -> tuple[Interval, str]:
    """The mean held-out evaluation of a condition's last quarter minus the quarter before, and what it says."""
    ci = mean_ci(by_seed(runs, "eval_rise"))
    if not ci.resolved:
        return ci, "–"
    return ci, ("settled" if -SETTLED_BAND < ci.low and ci.high < SETTLED_BAND else "still rising" if ci.low > 0
                else "falling" if ci.high < 0 else "not shown to settle")


KINDS: dict[str, type[Claim]] = {"compare": Compare, "across": Across, "stabler": Stabler, "collapses": Collapses}


class Setting(BaseModel):
    """A line of the page's recommendation (vespo.lab.recommend): a sweep, the axis it picks among, and the
    values of another axis it is given at."""

    model_config = ConfigDict(extra="forbid")
    setting: str
    sweep: str
    among: str
    over: str | None = None
    at: list[str] | None = None


class Claims(BaseModel):
    model_config = ConfigDict(extra="forbid")
    claims: list[Any]  # each a Claim once loaded
    headline: str | None = None  # the sweep whose headline figure leads the results page
    recommend: list[Setting] = []
    read_together: list[list[PositiveInt]] = []  # claims (1-based) read side by side
    source: str = ""


def load_claims(path: str | Path) -> Claims:
    path = Path(path)
    try:
        claims = Claims.model_validate({**load_yaml(path, "claims", ClaimsError), "source": str(path)})
    except ValidationError as e:
        raise ClaimsError(f"{path}: {one_line(e)}") from None
    claims.claims = [parse_claim(c, f"{path.name}, claim {i + 1}") for i, c in enumerate(claims.claims)]
    if any(i > len(claims.claims) for t in claims.read_together for i in t):
        raise ClaimsError(f"{path}: read_together must be lists of claim numbers 1..{len(claims.claims)}")
    return claims


def parse_claim(entry: Any, where: str) -> Claim:
    kinds = [k for k in KINDS if k in entry] if isinstance(entry, dict) else []
    if len(kinds) != 1:
        raise ClaimsError(f"{where}: give exactly one of {', '.join(KINDS)}, got {kinds or entry!r}")
    kind = kinds[0]
    body = {"select": entry[kind]} if kind == "collapses" else entry[kind]
    if not isinstance(body, dict):
        raise ClaimsError(f"{where}: {kind} must be a mapping {{a: ..., b: ...}}")
    try:
        return KINDS[kind].model_validate({**{k: v for k, v in entry.items() if k != kind}, **body, "where": where})
    except ValidationError as e:
        raise ClaimsError(f"{where}: {kind}: {one_line(e)}") from None


def check_claims(claims: Claims, sweeps: dict[str, Sweep], strict: bool = True) -> None:
    """Check every claim against its sweep's grid: the sweep exists (unless not ``strict``: then a claim of a
    sweep not given says "not run"), the selections use its axes and values, a comparison names one condition."""
    if strict and claims.headline is not None and claims.headline not in sweeps:
        raise ClaimsError(f"{claims.source}: headline sweep {claims.headline!r} is not one of {sorted(sweeps)}")
    for c in claims.claims:
        if c.sweep not in sweeps:
            if strict:
                raise ClaimsError(f"{c.where}: no sweep named {c.sweep!r}; sweeps: {sorted(sweeps)}")
            continue
        values, over, control = sweeps[c.sweep].values, getattr(c, "over", None), getattr(c, "control", None)
        try:
            if over is not None and over not in values:
                raise ValueError(f"no axis {over!r}; axes: {list(values)}")
            if isinstance(c, Across) and c.kind in ("increasing", "decreasing"):
                [math.log2(float(v)) for v in values[over]]
            for side in [c.a, *c.b] if hasattr(c, "a") else [c.select]:
                if bad := off_grid(values, side):
                    raise ValueError(bad)
                free = [a for a in values if a not in (SEED_AXIS, over) and len(values[a]) > 1 and a not in side]
                if free and not isinstance(c, Collapses):
                    raise ValueError(f"{side} leaves the axis/axes {free} open; a comparison names one condition")
            if control is not None and (strict or control.sweep in sweeps):
                if control.sweep not in sweeps:
                    raise ValueError(f"control sweep {control.sweep!r} is not one of {sorted(sweeps)}")
                if bad := off_grid(sweeps[control.sweep].values, control.where):
                    raise ValueError(bad)
        except ValueError as e:
            raise ClaimsError(f"{c.where}: sweep {c.sweep!r}: {e}") from None


def evaluate(claims: Claims, sweeps: dict[str, Sweep], runs: pd.DataFrame) -> list[Verdict]:
    check_claims(claims, sweeps, strict=False)
    return decide([c.judge(runs) for c in claims.claims])


def decide(verdicts: list[Verdict]) -> list[Verdict]:
    """Holm over the tests of every verdict, one family per reading (the claims' own metrics, greedy,
    last-quarter mean); then each claim's verdict on each reading, and the claim's verdict."""
    for family in zip_longest(*(v.readings.values() for v in verdicts), fillvalue=[]):  # the i-th reading of each
        tests = [t for ts in family for t in ts if t.verdict and t.n >= MIN_SEEDS]
        for t, p in zip(tests, holm([t.p for t in tests])):
            t.adjusted = p
    for v in (v for v in verdicts if v.readings):
        by = {m: combine([t.outcome for t in tests]) for m, tests in v.readings.items()}
        first, seen = next(iter(by.values())), set(by.values())
        v.verdict = first
        if len(seen) > 1 and first != NO_VERDICT and (resolved := seen & {AGREES, DISAGREES}):
            holds = " and ".join(READINGS[m] for m in by if by[m] in resolved)
            one = len(resolved) == 1 and not any(other_side(v).values())
            v.verdict = f"{resolved.pop()} on {holds} only" if one else DEPENDS
    return verdicts


def other_side(v: Verdict) -> dict[str, list[str]]:
    """Per reading after the first, its tests that lie on the other side of the claim's line than the first
    reading's test of the same name (the readings disagree in sign there, not only in what resolves)."""
    (_, first), *others = v.readings.items()
    side = {t.name: t.side for t in first if t.n}
    return {m: [t.name for t in tests if t.n and t.side * side.get(t.name, 0) < 0] for m, tests in others}


def combine(outcomes: list[str]) -> str:
    """One verdict for a claim made of several tests: agrees only if all do; any disagreement disagrees."""
    if not outcomes or all(o == NO_VERDICT for o in outcomes):
        return NO_VERDICT
    for verdict, rule in ((NOT_RUN, all), (DISAGREES, any), (AGREES, all)):
        if rule(o == verdict for o in outcomes):
            return verdict
    return TOO_FEW if TOO_FEW in outcomes and UNRESOLVED not in outcomes else UNRESOLVED
