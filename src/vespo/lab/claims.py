"""The paper's claims, each with the rule that decides it from the lab's sweeps.

A claims file (configs/lab/claims.yaml) lists claims; each names a sweep (by its `name`), one
kind of evidence, and what the paper expects of it:

    claims:
      - paper: "Under N = 64 VESPO ends above GRPO"
        sweep: staleness
        compare: {a: {loss: vespo, N: "64"}, b: {loss: grpo, N: "64"}}   # b may be a list
        metric: eval_sampled             # default; any of vespo.lab.results.METRICS
        expect: greater                  # greater | less | {within: m} | {at_least: m} | report
      - paper: "SAPO collapses under large N"
        sweep: staleness
        collapses: {loss: sapo, N: ["32", "64"]}
        expect: most                     # most | some | none
      - paper: "VESPO's stable learning-rate range is the widest"
        sweep: lr_range
        lr_range: {loss: vespo}
        expect: widest

Verdicts, from the 90% bootstrap interval of the paired difference a - b over seeds (same seed =
same warm start and prompt order):

    greater      interval above 0: agrees; below 0: disagrees; contains 0: not resolved
    less         the mirror image
    within m     interval inside (-m, m): agrees; entirely outside [-m, m]: disagrees; else not resolved
    at_least m   a - b >= m ("matches or beats" with m < 0): interval above m: agrees; below: disagrees
    report       measured and shown, no verdict
    most         at least half of the selected runs collapsed: agrees; none: disagrees; else partly
    some         at least one collapsed: agrees; none: not resolved ("can collapse" is not refuted)
    none         no run collapsed: agrees; any: disagrees
    widest       the named condition's stable lr range (vespo.lab.lr_range) is at least as wide as
                 every other condition's: agrees; another is wider: disagrees; a grid with runs
                 still to finish: not resolved (more seeds can only narrow a range)

With a list of b, every comparison must agree for the claim to agree; any disagreement makes it
disagree. A sweep that was not run, or cells without finished runs, give "not run".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vespo.lab.grid import SEED_AXIS
from vespo.lab.lr_range import LR_AXIS, LrRange, lr_ranges, lr_text
from vespo.lab.results import METRICS, RunResult, by_seed, conditions, group, select
from vespo.lab.stats import Paired, paired_difference

KINDS = ("compare", "collapses", "lr_range")
PAIRED_EXPECT = ("greater", "less", "within", "at_least", "report")
COLLAPSE_EXPECT = ("most", "some", "none")
AGREES, DISAGREES, UNRESOLVED, PARTLY, NOT_RUN, NO_VERDICT = (
    "agrees", "disagrees", "not resolved", "partly", "not run", "—")


class ClaimsError(ValueError):
    """A claims file is malformed, or a claim selects cells its sweep does not have."""


@dataclass(frozen=True)
class Claim:
    paper: str  # what the paper says
    sweep: str  # the sweep's name
    kind: str  # compare | collapses | lr_range
    spec: dict  # the kind's selection
    expect: str
    margin: float = math.nan  # for within / at_least
    metric: str = "eval_sampled"
    where: str = ""  # "claims.yaml, claim 3", for error messages


@dataclass
class Claims:
    claims: list[Claim]
    headline: str | None = None  # the sweep whose headline figure leads the results page
    source: str = ""


@dataclass
class Verdict:
    claim: Claim
    measured: str
    verdict: str
    parts: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- the file


def load_claims(path: str | Path) -> Claims:
    path = Path(path)
    if not path.is_file():
        raise ClaimsError(f"claims file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("claims"), list):
        raise ClaimsError(f"{path}: expected a mapping with a 'claims' list")
    unknown = set(data) - {"claims", "headline"}
    if unknown:
        raise ClaimsError(f"{path}: unknown key(s) {sorted(unknown)}; valid: claims, headline")
    return Claims([_claim(c, f"{path.name}, claim {i + 1}") for i, c in enumerate(data["claims"])],
                  data.get("headline"), str(path))


def _claim(c: Any, where: str) -> Claim:
    if not isinstance(c, dict):
        raise ClaimsError(f"{where}: must be a mapping, got {c!r}")
    valid = {"paper", "sweep", "metric", "expect", *KINDS}
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
    spec = c[kind]
    if kind == "compare":
        if not isinstance(spec, dict) or set(spec) != {"a", "b"}:
            raise ClaimsError(f"{where}: compare must be {{a: {{axis: value}}, b: {{...}} or [{{...}}, ...]}}")
        bs = spec["b"] if isinstance(spec["b"], list) else [spec["b"]]
        if not all(isinstance(x, dict) for x in [spec["a"], *bs]):
            raise ClaimsError(f"{where}: compare.a and compare.b must be mappings axis -> value")
        spec = {"a": spec["a"], "b": bs}
    elif not isinstance(spec, dict):
        raise ClaimsError(f"{where}: {kind} must be a mapping axis -> value(s)")
    return Claim(str(c["paper"]), str(c["sweep"]), kind, spec, expect, margin, metric, where)


def _expect(value: Any, kind: str, where: str) -> tuple[str, float]:
    allowed = {"compare": PAIRED_EXPECT, "collapses": COLLAPSE_EXPECT, "lr_range": ("widest",)}[kind]
    if isinstance(value, dict) and len(value) == 1 and kind == "compare":
        (name, margin), = value.items()
        if name in ("within", "at_least") and isinstance(margin, (int, float)):
            if name == "within" and margin <= 0:
                raise ClaimsError(f"{where}: within needs a margin > 0, got {margin}")
            return name, float(margin)
    elif isinstance(value, str) and value in allowed and value not in ("within", "at_least"):
        return value, math.nan
    raise ClaimsError(f"{where}: expect {value!r} is not valid for {kind}; choose one of "
                      + ", ".join(f"{{{a}: margin}}" if a in ("within", "at_least") else a for a in allowed))


def check_claims(claims: Claims, records: dict[str, dict]) -> None:
    """Check every claim against its sweep's grid (records by sweep name: {"name", "axes"}), before
    anything has run: the sweep exists, the selections use its axes and values, a comparison fixes
    every axis but the seed."""
    if claims.headline is not None and claims.headline not in records:
        raise ClaimsError(f"{claims.source}: headline sweep {claims.headline!r} is not one of {sorted(records)}")
    for c in claims.claims:
        if c.sweep not in records:
            raise ClaimsError(f"{c.where}: no sweep named {c.sweep!r}; sweeps: {sorted(records)}")
        record = records[c.sweep]
        try:
            for where in ([c.spec["a"], *c.spec["b"]] if c.kind == "compare" else [c.spec]):
                select(record, [], where)
            if c.kind == "compare":
                free = [a["label"] for a in record["axes"] if a["label"] != SEED_AXIS and len(a["values"]) > 1]
                for side, where in [("a", c.spec["a"]), *(("b", b) for b in c.spec["b"])]:
                    if set(free) - set(where):
                        raise ValueError(f"compare.{side} {where} leaves the axis/axes {sorted(set(free) - set(where))} "
                                         "open; a comparison names one condition")
            if c.kind == "lr_range" and LR_AXIS not in [a["label"] for a in record["axes"]]:
                raise ValueError(f"sweep {c.sweep!r} has no {LR_AXIS!r} axis")
        except ValueError as e:
            raise ClaimsError(f"{c.where}: {e}") from None


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
            out.append({"compare": _compare, "collapses": _collapses, "lr_range": _lr}[claim.kind](
                claim, record, results))
        except ValueError as e:
            raise ClaimsError(f"{claim.where}: {e}") from None
    return out


def _compare(claim: Claim, record: dict, results: list[RunResult]) -> Verdict:
    a_runs = _one_condition(record, results, claim.spec["a"], "a")
    parts, verdicts = [], []
    for b in claim.spec["b"]:
        b_runs = _one_condition(record, results, b, "b")
        name = ", ".join(f"{k}={v}" for k, v in b.items() if str(claim.spec["a"].get(k)) != str(v)) or "b"
        if not any(r.usable for r in a_runs) or not any(r.usable for r in b_runs):
            parts.append(f"vs {name}: no finished runs")
            verdicts.append(NOT_RUN)
            continue
        p = paired_difference(by_seed(a_runs, claim.metric), by_seed(b_runs, claim.metric))
        parts.append(f"vs {name}: {paired_text(p)}")
        verdicts.append(paired_verdict(p, claim.expect, claim.margin))
    return Verdict(claim, f"{claim.metric} difference " + "; ".join(parts), combine(verdicts), parts)


def _one_condition(record: dict, results: list[RunResult], where: dict, side: str) -> list[RunResult]:
    runs = select(record, results, where)
    cells = group(runs, conditions(record))
    if len(cells) > 1:
        free = [a for a in conditions(record) if len({k[conditions(record).index(a)] for k in cells}) > 1]
        raise ValueError(f"compare.{side} {where} selects {len(cells)} conditions; fix the axis/axes {free}")
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
    if not d.resolved:
        return UNRESOLVED
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
    return UNRESOLVED


def _collapses(claim: Claim, record: dict, results: list[RunResult]) -> Verdict:
    runs = [r for r in select(record, results, claim.spec) if r.usable]
    if not runs:
        return Verdict(claim, "no finished runs", NOT_RUN)
    dead = [r for r in runs if r.collapse.collapsed]
    reasons = {}
    for r in dead:
        reasons[r.collapse.reason] = reasons.get(r.collapse.reason, 0) + 1
    text = f"{len(dead)}/{len(runs)} runs collapsed" + (
        " (" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")" if reasons else "")
    return Verdict(claim, text, collapse_verdict(len(dead), len(runs), claim.expect))


def collapse_verdict(dead: int, runs: int, expect: str) -> str:
    if expect == "none":
        return AGREES if dead == 0 else DISAGREES
    if expect == "some":  # "can collapse": none in these runs does not show it, nor refute it
        return AGREES if dead else UNRESOLVED
    return AGREES if 2 * dead >= runs else DISAGREES if dead == 0 else PARTLY


def _lr(claim: Claim, record: dict, results: list[RunResult]) -> Verdict:
    ranges = lr_ranges(record, results, claim.metric)
    mine = [r for r in ranges if all(str(r.condition.get(k)) == str(v) for k, v in claim.spec.items())]
    if len(mine) != 1:
        raise ValueError(f"lr_range {claim.spec} matches {len(mine)} conditions of {[r.condition for r in ranges]}")
    target, others = mine[0], [r for r in ranges if r is not mine[0]]
    parts = [lr_range_text(r) for r in [target, *others]]
    if all(p.runs == 0 for p in target.points):
        return Verdict(claim, "no finished runs", NOT_RUN, parts)
    # a range is "no run at any seed collapsed": with seeds still to run it can only shrink, so an
    # unfinished grid decides nothing
    planned = math.prod(len(a["values"]) for a in record.get("axes", []))
    usable = sum(p.runs for r in ranges for p in r.points)
    if usable < planned:
        return Verdict(claim, "; ".join(parts) + f"; {usable} of {planned} runs finished: not decided until the "
                       "sweep is complete", UNRESOLVED, parts)
    wider = [r for r in others if _width(r) > _width(target)]
    tied = [_name(r) for r in others if _width(r) == _width(target)]
    measured = "; ".join(parts) + (f"; no wider than (tied): {', '.join(tied)}" if tied and not wider else "")
    return Verdict(claim, measured, DISAGREES if wider else AGREES, parts)


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
