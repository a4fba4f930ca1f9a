"""The paper's claims, each with the rule that decides it from the lab's sweeps.

A claims file (configs/lab/claims.yaml) lists claims; each names a sweep (by its `name`), one
kind of evidence, and what the paper expects of it:

    claims:
      - paper: "GRPO weakens as N grows"
        sweep: staleness
        across: {a: {loss: grpo}, over: N}                  # a trend over N: a's slope per doubling
        expect: decreasing                                  # increasing | decreasing
      - paper: "Under large N VESPO ends above GRPO"
        sweep: staleness
        across: {a: {loss: vespo}, b: {loss: grpo}, over: N, at: ["8", "64"]}   # a - b at each N
        expect: greater                                     # greater | less | {within: m} | {at_least: m} | report
      - paper: "Asymmetric (k, lambda) beats symmetric"
        sweep: asymmetry
        compare: {a: {kernel: asymmetric}, b: {kernel: symmetric_pos}}          # one condition each; b may be a list
        metric: eval_sampled                                # default; any of vespo.lab.results.METRICS
        expect: greater
      - paper: "SAPO collapses under large N"
        sweep: staleness
        collapses: {loss: sapo, N: "64"}
        expect: most                                        # most | some | none
      - paper: "VESPO does not collapse"
        sweep: staleness
        collapses: {loss: vespo}
        control: {sweep: lr_range, where: {loss: vespo, lr: "1.25e-3"}}   # where the rule does fire
        expect: none
      - paper: "VESPO's stable learning-rate range is the widest"
        sweep: lr_range
        lr_range: {loss: vespo}
        expect: widest

Verdicts come from the interval of a paired difference over seeds (vespo.lab.stats: a t-interval;
same seed = same warm start and prompt order). `rules_text()` writes them out in words; in short:

    greater / less   interval above / below 0 agrees, on the other side disagrees, else not resolved
    within m         interval inside (-m, m) agrees; wholly outside [-m, m] disagrees
    at_least m       interval above m agrees; below m disagrees
    increasing /     the per-seed least-squares slope of (a - b), or of a, against log2 of the `over`
    decreasing       axis: its interval above / below 0 agrees, on the other side disagrees
    most / some /    collapsed runs (vespo.lab.collapse): most = at least half (none of fewer than 5
    none             runs is "too few seeds": the rate's interval still reaches one half), some = at
                     least one (none collapsing leaves "can collapse" not resolved), none = zero, and only
                     beside a `control` where the rule fired; without one it is not resolved
    widest           the condition's stable lr range (vespo.lab.lr_range) is at least as wide as
                     every other's; a grid with runs still to finish decides nothing

`across` with a comparison expectation judges every value of the `over` axis (or those in `at`) and
combines them like a list of b. A claim made of several comparisons agrees only if all of them do;
any disagreement makes it disagree. Fewer than stats.MIN_SEEDS common seeds: "too few seeds". A
sweep that was not run, or cells without finished runs: "not run". Each verdict carries a label of
how robust it is (`robustness`): the effect size and how many seeds agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vespo.lab.grid import SEED_AXIS, planned
from vespo.lab.lr_range import LR_AXIS, LrPoint, LrRange, lr_ranges, lr_text, widest_stable
from vespo.lab.results import METRICS, RunResult, by_seed, conditions, group, select
from vespo.lab.stats import CONFIDENCE, METHOD, MIN_SEEDS, Paired, paired_difference, rate_ci

KINDS = ("compare", "across", "collapses", "lr_range")
PAIRED_EXPECT = ("greater", "less", "within", "at_least", "report")
TREND_EXPECT = ("increasing", "decreasing")
COLLAPSE_EXPECT = ("most", "some", "none")
AGREES, DISAGREES, UNRESOLVED, PARTLY, NOT_RUN, NO_VERDICT, TOO_FEW = (
    "agrees", "disagrees", "not resolved", "partly", "not run", "—", "too few seeds")
ROBUST, SUPPORTED, UNCLEAR, FRAGILE = "robust", "supported", "unclear", "fragile"
ROBUST_SHARE = 0.9  # "robust": the interval on one side of the claim's line, and at least this share of seeds ...
ROBUST_SEEDS = 5  # ... out of at least this many seeds


class ClaimsError(ValueError):
    """A claims file is malformed, or a claim selects cells its sweep does not have."""


@dataclass(frozen=True)
class Claim:
    paper: str  # what the paper says
    sweep: str  # the sweep's name
    kind: str  # compare | across | collapses | lr_range
    spec: dict  # the kind's selection
    expect: str
    margin: float = math.nan  # for within / at_least
    metric: str = "eval_sampled"
    where: str = ""  # "claims.yaml, claim 3", for error messages
    control: dict | None = None  # collapses: {sweep, where} of a setting where the rule fires


@dataclass
class Claims:
    claims: list[Claim]
    headline: str | None = None  # the sweep whose headline figure leads the results page
    recommend: list[dict] = field(default_factory=list)  # settings for the recommendation (vespo.lab.recommend)
    source: str = ""


@dataclass
class Verdict:
    claim: Claim
    measured: str
    verdict: str
    parts: list[str] = field(default_factory=list)
    robustness: str = ""  # robust | supported | unclear | fragile | too few seeds | "" (no label)


# ---------------------------------------------------------------- the file


def load_claims(path: str | Path) -> Claims:
    path = Path(path)
    if not path.is_file():
        raise ClaimsError(f"claims file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("claims"), list):
        raise ClaimsError(f"{path}: expected a mapping with a 'claims' list")
    unknown = set(data) - {"claims", "headline", "recommend"}
    if unknown:
        raise ClaimsError(f"{path}: unknown key(s) {sorted(unknown)}; valid: claims, headline, recommend")
    recommend = data.get("recommend") or []
    if not isinstance(recommend, list) or not all(isinstance(r, dict) for r in recommend):
        raise ClaimsError(f"{path}: recommend must be a list of mappings")
    return Claims([_claim(c, f"{path.name}, claim {i + 1}") for i, c in enumerate(data["claims"])],
                  data.get("headline"), recommend, str(path))


def _claim(c: Any, where: str) -> Claim:
    if not isinstance(c, dict):
        raise ClaimsError(f"{where}: must be a mapping, got {c!r}")
    valid = {"paper", "sweep", "metric", "expect", "control", *KINDS}
    if set(c) - valid:
        raise ClaimsError(f"{where}: unknown key(s) {sorted(set(c) - valid)}; valid: {sorted(valid)}")
    for key in ("paper", "sweep", "expect"):
        if key not in c:
            raise ClaimsError(f"{where}: missing {key!r}")
    kinds = [k for k in KINDS if k in c]
    if len(kinds) != 1:
        raise ClaimsError(f"{where}: give exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
    kind, metric = kinds[0], c.get("metric", "eval_sampled")
    if metric not in METRICS:
        raise ClaimsError(f"{where}: metric {metric!r} unknown; choose one of {', '.join(METRICS)}")
    expect, margin = _expect(c["expect"], kind, where)
    spec = _spec(c[kind], kind, where)
    if kind == "across" and expect not in TREND_EXPECT and not spec["b"]:
        raise ClaimsError(f"{where}: across with expect {c['expect']!r} compares a with b at each value; give b")
    control = _control(c.get("control"), kind, where)
    if kind == "collapses" and expect == "none" and control is None:
        raise ClaimsError(f"{where}: a 'none' collapse claim needs a control: {{sweep, where}} selecting runs where the "
                          "rule fires (otherwise 'no collapse' says nothing about the loss)")
    return Claim(str(c["paper"]), str(c["sweep"]), kind, spec, expect, margin, metric, where, control)


def _spec(spec: Any, kind: str, where: str) -> dict:
    if kind in ("compare", "across"):
        keys = {"a", "b"} if kind == "compare" else {"a", "b", "over", "at"}
        if not isinstance(spec, dict) or "a" not in spec or set(spec) - keys or (kind == "compare" and "b" not in spec) \
                or (kind == "across" and "over" not in spec):
            form = ("{a: {axis: value}, b: {...} or [{...}, ...]}" if kind == "compare" else
                    "{a: {axis: value}, b: {...} or [...] (optional), over: AXIS, at: [values] (optional)}")
            raise ClaimsError(f"{where}: {kind} must be {form}")
        bs = spec.get("b", [])
        bs = bs if isinstance(bs, list) else [bs]
        if not all(isinstance(x, dict) for x in [spec["a"], *bs]):
            raise ClaimsError(f"{where}: {kind}.a and {kind}.b must be mappings axis -> value")
        out = {"a": spec["a"], "b": bs}
        if kind == "across":
            at = spec.get("at")
            if at is not None and not isinstance(at, list):
                raise ClaimsError(f"{where}: across.at must be a list of values of {spec['over']!r}")
            out.update(over=str(spec["over"]), at=[str(v) for v in at] if at else None)
        return out
    if not isinstance(spec, dict):
        raise ClaimsError(f"{where}: {kind} must be a mapping axis -> value(s)")
    return spec


def _expect(value: Any, kind: str, where: str) -> tuple[str, float]:
    allowed = {"compare": PAIRED_EXPECT, "across": PAIRED_EXPECT + TREND_EXPECT, "collapses": COLLAPSE_EXPECT,
               "lr_range": ("widest",)}[kind]
    if isinstance(value, dict) and len(value) == 1 and kind in ("compare", "across"):
        (name, margin), = value.items()
        if name in ("within", "at_least") and isinstance(margin, (int, float)):
            if name == "within" and margin <= 0:
                raise ClaimsError(f"{where}: within needs a margin > 0, got {margin}")
            return name, float(margin)
    elif isinstance(value, str) and value in allowed and value not in ("within", "at_least"):
        return value, math.nan
    raise ClaimsError(f"{where}: expect {value!r} is not valid for {kind}; choose one of "
                      + ", ".join(f"{{{a}: margin}}" if a in ("within", "at_least") else a for a in allowed))


def _control(control: Any, kind: str, where: str) -> dict | None:
    if control is None:
        return None
    if kind != "collapses":
        raise ClaimsError(f"{where}: control applies to collapses claims only")
    if not isinstance(control, dict) or set(control) != {"sweep", "where"} or not isinstance(control["where"], dict):
        raise ClaimsError(f"{where}: control must be {{sweep: NAME, where: {{axis: value}}}}")
    return {"sweep": str(control["sweep"]), "where": control["where"]}


def check_claims(claims: Claims, records: dict[str, dict]) -> None:
    """Check every claim against its sweep's grid (records by sweep name: {"name", "axes"}), before
    anything has run: the sweep exists, the selections use its axes and values, a comparison fixes
    every axis but the seed (and, across, the `over` axis)."""
    if claims.headline is not None and claims.headline not in records:
        raise ClaimsError(f"{claims.source}: headline sweep {claims.headline!r} is not one of {sorted(records)}")
    for c in claims.claims:
        if c.sweep not in records:
            raise ClaimsError(f"{c.where}: no sweep named {c.sweep!r}; sweeps: {sorted(records)}")
        record = records[c.sweep]
        try:
            _check_claim(c, record, records)
        except ValueError as e:
            raise ClaimsError(f"{c.where}: {e}") from None


def _check_claim(c: Claim, record: dict, records: dict[str, dict]) -> None:
    sides = [c.spec["a"], *c.spec["b"]] if c.kind in ("compare", "across") else [c.spec]
    for where in sides:
        select(record, [], where)
    if c.kind in ("compare", "across"):
        axes = {a["label"]: a["values"] for a in record["axes"]}
        open_ok = {SEED_AXIS} | ({c.spec["over"]} if c.kind == "across" else set())
        if c.kind == "across":
            if c.spec["over"] not in axes:
                raise ValueError(f"across.over {c.spec['over']!r} is not an axis of sweep {c.sweep!r}; axes: {list(axes)}")
            select(record, [], {c.spec["over"]: c.spec["at"] or axes[c.spec["over"]]})
            _log2_values(axes[c.spec["over"]], c.spec["over"])
        free = [a for a, v in axes.items() if a not in open_ok and len(v) > 1]
        for side, where in [("a", c.spec["a"]), *(("b", b) for b in c.spec["b"])]:
            if set(free) - set(where):
                raise ValueError(f"{c.kind}.{side} {where} leaves the axis/axes {sorted(set(free) - set(where))} "
                                 "open; a comparison names one condition")
    if c.kind == "lr_range" and LR_AXIS not in [a["label"] for a in record["axes"]]:
        raise ValueError(f"sweep {c.sweep!r} has no {LR_AXIS!r} axis")
    if c.control is not None:
        if c.control["sweep"] not in records:
            raise ValueError(f"control sweep {c.control['sweep']!r} is not one of {sorted(records)}")
        select(records[c.control["sweep"]], [], c.control["where"])


def _log2_values(values: list[str], axis: str) -> list[float]:
    try:
        return [math.log2(float(v)) for v in values]
    except ValueError:
        raise ValueError(f"axis {axis!r} has values {values} that are not positive numbers: no trend over it") from None


# ---------------------------------------------------------------- evaluation


Sweeps = dict[str, tuple[dict, list[RunResult]]]  # sweep name -> (record, results)


def evaluate(claims: Claims, sweeps: Sweeps) -> list[Verdict]:
    out = []
    for claim in claims.claims:
        if claim.sweep not in sweeps:
            out.append(Verdict(claim, f"sweep {claim.sweep!r} not run", NOT_RUN))
            continue
        record, results = sweeps[claim.sweep]
        try:
            judge = {"compare": _compare, "across": _across, "collapses": _collapses, "lr_range": _lr}[claim.kind]
            out.append(judge(claim, record, results, sweeps))
        except ValueError as e:
            raise ClaimsError(f"{claim.where}: {e}") from None
    return out


def _compare(claim: Claim, record: dict, results: list[RunResult], sweeps: Sweeps) -> Verdict:
    a_runs = _one_condition(record, results, claim.spec["a"], "a")
    parts, verdicts, labels = [], [], []
    for b in claim.spec["b"]:
        b_runs = _one_condition(record, results, b, "b")
        name = ", ".join(f"{k}={v}" for k, v in b.items() if str(claim.spec["a"].get(k)) != str(v)) or "b"
        text, verdict, label = _paired_part(claim, a_runs, b_runs)
        parts.append(f"vs {name}: {text}")
        verdicts.append(verdict)
        labels.append(label)
    return Verdict(claim, f"{claim.metric} difference " + "; ".join(parts), combine(verdicts), parts, weakest(labels))


def _paired_part(claim: Claim, a_runs: list[RunResult], b_runs: list[RunResult]) -> tuple[str, str, str]:
    """(text, verdict, robustness) of one paired comparison."""
    if not any(r.usable for r in a_runs) or not any(r.usable for r in b_runs):
        return "no finished runs", NOT_RUN, ""
    p = paired_difference(by_seed(a_runs, claim.metric), by_seed(b_runs, claim.metric))
    return paired_text(p), paired_verdict(p, claim.expect, claim.margin), robustness(p, claim.expect, claim.margin)


def _across(claim: Claim, record: dict, results: list[RunResult], sweeps: Sweeps) -> Verdict:
    over = claim.spec["over"]
    values = claim.spec["at"] or _present(record, results, over)
    if claim.expect in TREND_EXPECT:
        return _trend(claim, record, results, values)
    parts, verdicts, labels = [], [], []
    for b in claim.spec["b"] or [{}]:
        for v in values:
            a_where, b_where = {over: v, **claim.spec["a"]}, {over: v, **b}
            if a_where == b_where:
                continue
            text, verdict, label = _paired_part(claim, _one_condition(record, results, a_where, "a"),
                                                _one_condition(record, results, b_where, "b"))
            name = ", ".join(f"{k}={x}" for k, x in b.items() if str(claim.spec["a"].get(k)) != str(x))
            parts.append(f"{over}={v}" + (f" vs {name}" if name else "") + f": {text}")
            verdicts.append(verdict)
            labels.append(label)
    return Verdict(claim, f"{claim.metric} difference at each {over}: " + "; ".join(parts), combine(verdicts), parts,
                   weakest(labels))


def _present(record: dict, results: list[RunResult], axis: str) -> list[str]:
    values = next(a["values"] for a in record["axes"] if a["label"] == axis)
    return [v for v in values if any(r.labels.get(axis) == v for r in results)]


def _trend(claim: Claim, record: dict, results: list[RunResult], values: list[str]) -> Verdict:
    """The slope per doubling of the `over` axis of (a - b), or of a, seed by seed, with its interval;
    and the value at each point of the axis (a - b, or a minus a at the first value)."""
    if claim.spec["b"][1:]:
        raise ValueError("a trend takes at most one b")
    over, b = claim.spec["over"], (claim.spec["b"] or [None])[0]
    xs = _log2_values(values, over)
    series = _series(claim, record, results, values, xs)
    parts = _trend_parts(series, over, values, xs, relative=b is None)
    slopes = {s: _slope(pts) for s, pts in series.items() if len(pts) >= 2}
    if not slopes:
        return Verdict(claim, "no finished runs", NOT_RUN, parts)
    p = _as_paired(slopes)
    head = f"{claim.metric}" + (f" difference vs {', '.join(f'{k}={x}' for k, x in b.items())}" if b else "")
    measured = f"{head}, slope per doubling of {over}: {paired_text(p)}; " + "; ".join(parts)
    expect = "greater" if claim.expect == "increasing" else "less"
    return Verdict(claim, measured, paired_verdict(p, expect), parts, robustness(p))


def _series(claim: Claim, record: dict, results: list[RunResult], values: list[str],
            xs: list[float]) -> dict[str, dict[float, float]]:
    """{seed: {log2 x: a - b (or a) at x}} over the `over` axis values."""
    over, b = claim.spec["over"], (claim.spec["b"] or [None])[0]
    series: dict[str, dict[float, float]] = {}
    for v, x in zip(values, xs):
        y = by_seed(_one_condition(record, results, {over: v, **claim.spec["a"]}, "a"), claim.metric)
        if b is not None:
            y = _diff(y, by_seed(_one_condition(record, results, {over: v, **b}, "b"), claim.metric))
        for seed, value in y.items():
            if math.isfinite(value):
                series.setdefault(seed, {})[x] = value
    return series


def _trend_parts(series: dict[str, dict[float, float]], over: str, values: list[str], xs: list[float],
                 relative: bool) -> list[str]:
    """The series at each value, paired by seed; ``relative``: minus its value at the first one."""
    parts = []
    for v, x in zip(values, xs):
        at = {s: pts[x] for s, pts in series.items() if x in pts}
        if not relative:
            parts.append(f"{over}={v}: {paired_text(_as_paired(at))}")
        elif v != values[0]:
            first = {s: pts[xs[0]] for s, pts in series.items() if xs[0] in pts}
            parts.append(f"{over}={v} minus {over}={values[0]}: {paired_text(_as_paired(_diff(at, first)))}")
    return parts


def _diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {s: a[s] - b[s] for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])}


def _as_paired(d: dict[str, float]) -> Paired:
    return paired_difference(d, {s: 0.0 for s in d})


def _slope(points: dict[float, float]) -> float:
    x = np.array(list(points), dtype=np.float64)  # [k] log2 of the axis values
    y = np.array(list(points.values()), dtype=np.float64)  # [k]
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc ** 2).sum())


def _one_condition(record: dict, results: list[RunResult], where: dict, side: str) -> list[RunResult]:
    runs = select(record, results, where)
    cells = group(runs, conditions(record))
    if len(cells) > 1:
        free = [a for a in conditions(record) if len({k[conditions(record).index(a)] for k in cells}) > 1]
        raise ValueError(f"{side} {where} selects {len(cells)} conditions; fix the axis/axes {free}")
    return runs


def paired_text(p: Paired) -> str:
    d = p.diff
    if d.n == 0:
        return "no common seeds"
    ci = f" [{d.low:+.3f}, {d.high:+.3f}]" if d.resolved else " (one seed: no interval)"
    return f"{d.mean:+.3f}{ci}, {d.n} seeds, higher in {p.wins}"


def paired_verdict(p: Paired, expect: str, margin: float = math.nan) -> str:
    d = p.diff
    if expect == "report":
        return NO_VERDICT
    if d.n == 0:
        return NOT_RUN
    if d.n < MIN_SEEDS:
        return TOO_FEW
    lo, hi = round(d.low, 12), round(d.high, 12)  # an endpoint on a boundary up to float rounding is on it
    if expect == "greater":
        return AGREES if lo > 0 else DISAGREES if hi < 0 else UNRESOLVED
    if expect == "less":
        return AGREES if hi < 0 else DISAGREES if lo > 0 else UNRESOLVED
    if expect == "within":
        return AGREES if -margin < lo and hi < margin else DISAGREES if lo > margin or hi < -margin else UNRESOLVED
    if expect == "at_least":
        return AGREES if lo > margin else DISAGREES if hi < margin else UNRESOLVED
    raise ValueError(f"unknown expectation {expect!r}")


def robustness(p: Paired, expect: str = "greater", margin: float = math.nan) -> str:
    """How firmly the seeds decide a comparison, against the line its claim draws (0, or the margin):
    robust = the interval lies on one side of it and at least ROBUST_SHARE of at least ROBUST_SEEDS
    seeds do too, each on its own; supported = the interval lies on one side; unclear = it does not;
    too few seeds = no interval."""
    d = p.diff
    if d.n < MIN_SEEDS:
        return TOO_FEW if d.n else ""
    if expect == "within":
        inside = [abs(x) < margin for x in p.values]
        if -margin < d.low and d.high < margin:
            side = sum(inside)
        elif d.low > margin or d.high < -margin:
            side = len(inside) - sum(inside)
        else:
            return UNCLEAR
    else:
        line = margin if expect == "at_least" else 0.0
        if not (d.low > line or d.high < line):
            return UNCLEAR
        side = sum(x > line for x in p.values) if d.low > line else sum(x < line for x in p.values)
    return ROBUST if d.n >= ROBUST_SEEDS and side >= ROBUST_SHARE * d.n else SUPPORTED


def weakest(labels: list[str]) -> str:
    order = [TOO_FEW, FRAGILE, UNCLEAR, SUPPORTED, ROBUST]
    ranked = [x for x in labels if x in order]
    return min(ranked, key=order.index) if ranked else ""


def combine(verdicts: list[str]) -> str:
    """One verdict for a claim made of several comparisons."""
    if all(v == NO_VERDICT for v in verdicts):
        return NO_VERDICT
    if all(v == NOT_RUN for v in verdicts):
        return NOT_RUN
    if any(v == DISAGREES for v in verdicts):
        return DISAGREES
    if all(v == AGREES for v in verdicts):
        return AGREES
    if any(v == TOO_FEW for v in verdicts) and not any(v == UNRESOLVED for v in verdicts):
        return TOO_FEW
    return UNRESOLVED


# ---------------------------------------------------------------- collapse claims


def _collapses(claim: Claim, record: dict, results: list[RunResult], sweeps: Sweeps) -> Verdict:
    runs = [r for r in select(record, results, claim.spec) if r.usable]
    if not runs:
        return Verdict(claim, "no finished runs", NOT_RUN)
    text = collapse_text(runs)
    verdict = collapse_verdict(sum(r.collapse.collapsed for r in runs), len(runs), claim.expect)
    if claim.control is None:
        return Verdict(claim, text, verdict)
    control = _control_runs(claim.control, sweeps)
    name = f"{claim.control['sweep']} " + ", ".join(f"{k}={v}" for k, v in claim.control["where"].items())
    if not control:
        return Verdict(claim, f"{text}; control ({name}) not run: the rule was not seen to fire", UNRESOLVED)
    fired = sum(r.collapse.collapsed for r in control)
    text += f"; control ({name}): {collapse_text(control)}"
    if not fired and verdict == AGREES and claim.expect == "none":
        return Verdict(claim, text + ": the rule fired in no control run, so 'no collapse' says nothing", UNRESOLVED)
    return Verdict(claim, text, verdict)


def _control_runs(control: dict, sweeps: Sweeps) -> list[RunResult]:
    if control["sweep"] not in sweeps:
        return []
    record, results = sweeps[control["sweep"]]
    return [r for r in select(record, results, control["where"]) if r.usable]


def collapse_text(runs: list[RunResult]) -> str:
    """"2/10 runs collapsed (reward 2), rate 0.20 [0.04, 0.51]"."""
    dead = [r for r in runs if r.collapse.collapsed]
    reasons: dict[str, int] = {}
    for r in dead:
        reasons[r.collapse.reason] = reasons.get(r.collapse.reason, 0) + 1
    rate = rate_ci(len(dead), len(runs))
    return (f"{len(dead)}/{len(runs)} runs collapsed"
            + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")" if reasons else "")
            + f", rate {rate.mean:.2f} [{rate.low:.2f}, {rate.high:.2f}]")


def collapse_verdict(dead: int, runs: int, expect: str) -> str:
    if expect == "none":
        return AGREES if dead == 0 else DISAGREES
    if expect == "some":  # "can collapse": none in these runs does not show it, nor refute it
        return AGREES if dead else UNRESOLVED
    if dead == 0 and rate_ci(0, runs).high >= 0.5:  # too few runs: none collapsing cannot rule out "most"
        return TOO_FEW
    return AGREES if 2 * dead >= runs else DISAGREES if dead == 0 else PARTLY


# ---------------------------------------------------------------- the learning-rate range


def _lr(claim: Claim, record: dict, results: list[RunResult], sweeps: Sweeps) -> Verdict:
    ranges = lr_ranges(record, results, claim.metric)
    mine = [r for r in ranges if all(str(r.condition.get(k)) == str(v) for k, v in claim.spec.items())]
    if len(mine) != 1:
        raise ValueError(f"lr_range {claim.spec} matches {len(mine)} conditions of {[r.condition for r in ranges]}")
    target = mine[0]
    parts = [lr_range_text(r) for r in [target, *(r for r in ranges if r is not target)]]
    if all(p.runs == 0 for p in target.points):
        return Verdict(claim, "no finished runs", NOT_RUN, parts)
    # a range is "no run at any seed collapsed": with seeds still to run it can only shrink, so an
    # unfinished grid decides nothing
    usable, grid = sum(p.runs for r in ranges for p in r.points), planned(record)
    if usable < grid:
        return Verdict(claim, "; ".join(parts) + f"; {usable} of {grid} runs finished: not decided until the "
                       "sweep is complete", UNRESOLVED, parts)
    verdict, tied = widest_verdict(target, ranges)
    fragile = one_run_decides(target, ranges)
    measured = "; ".join(parts) + (f"; no wider than (tied): {', '.join(tied)}" if tied and verdict == AGREES else "")
    measured += "; one run's collapse decides it" if fragile else "; no single run's collapse changes it"
    return Verdict(claim, measured, verdict, parts, FRAGILE if fragile else ROBUST)


def widest_verdict(target: LrRange, ranges: list[LrRange]) -> tuple[str, list[str]]:
    others = [r for r in ranges if r is not target]
    wider = [r for r in others if _width(r) > _width(target)]
    return (DISAGREES if wider else AGREES), [_name(r) for r in others if _width(r) == _width(target)]


def one_run_decides(target: LrRange, ranges: list[LrRange]) -> bool:
    """Whether flipping one run (a collapse into none, or none into a collapse) changes the verdict."""
    base, _ = widest_verdict(target, ranges)
    for i, r in enumerate(ranges):
        for j, p in enumerate(r.points):
            for delta in (-1, 1):
                if not 0 <= p.collapsed + delta <= p.runs:
                    continue
                points = list(r.points)
                points[j] = LrPoint(p.lr, p.label, p.runs, p.missing, p.collapsed + delta, p.reward)
                low, high, best = widest_stable(points)
                flipped = LrRange(r.condition, points, low, high, best)
                changed = [flipped if k == i else x for k, x in enumerate(ranges)]
                if widest_verdict(changed[ranges.index(target)], changed)[0] != base:
                    return True
    return False


def _width(r: LrRange) -> float:
    return r.width if r.low is not None else 0.0


def _name(r: LrRange) -> str:
    return ", ".join(r.condition.values()) or "all"


def lr_range_text(r: LrRange) -> str:
    name = _name(r)
    incomplete = " (incomplete)" if any(p.missing for p in r.points) else ""
    if r.low is None:
        return f"{name}: no stable lr{incomplete}"
    return f"{name}: {r.width:.3g}x ({lr_text(r.low)} to {lr_text(r.high)}){incomplete}"


# ---------------------------------------------------------------- the rules in words


def rules_text() -> str:
    """How a row is decided, from the constants the code uses."""
    level = f"{CONFIDENCE:.0%}"
    return (
        f"How a row is decided (the rule is written beside each claim in the claims file): a paired difference over "
        f"seeds ({METHOD}, {level}) whose interval lies above 0 agrees with a claim that it is positive, below 0 "
        "disagrees, containing 0 is not resolved; \"within m\" agrees when the interval lies inside (-m, m); \"at "
        "least m\" (matches or beats, m < 0) agrees when the interval lies above m. A claim across N is judged at "
        "each N it names, or as a trend: the least-squares slope per doubling of N of each seed's values, with its "
        f"{level} interval over seeds. Collapse claims count collapsed runs (most: at least half; some: at least one, "
        "and none collapsing leaves \"can collapse\" not resolved; most with none collapsing is \"too few seeds\" "
        "until the rate's interval lies below one half, from 5 runs on; none: zero, and only beside a control "
        "setting where the rule fired); the lr-range claim compares the widest learning-rate interval with no collapsed run. "
        f"A claim made of several comparisons agrees only if all of them do. Fewer than {MIN_SEEDS} common seeds: "
        f"\"too few seeds\". Robustness, against the line a claim draws (0, or its margin): *{ROBUST}* = the "
        f"interval lies on one side of it and so do at least {ROBUST_SHARE:.0%} of at least {ROBUST_SEEDS} seeds, each "
        f"on its own; *{SUPPORTED}* = the interval lies on one side; *{UNCLEAR}* = it does not; *{FRAGILE}* = one "
        "run's collapse would change an lr-range verdict.")
