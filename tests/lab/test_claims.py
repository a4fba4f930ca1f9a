"""Claims against hand-made sweep directories: each rule gives agrees / disagrees / not resolved
where it should, a malformed claims file names the claim, and the shipped claims file fits the
shipped sweep files."""

from pathlib import Path

import pytest
import yaml

from vespo.lab import claims as cl
from vespo.lab.grid import load_sweep
from vespo.lab.results import read_sweep

LAB = Path(__file__).resolve().parents[2] / "configs" / "lab"


def _claims(tmp_path, entries, headline=None):
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({"claims": entries, **({"headline": headline} if headline else {})}))
    return cl.load_claims(path)


def _sweep(synthetic, evals, collapsed=()):
    """evals: {loss: [held-out per seed]}; collapsed: set of (loss, seed)."""
    losses = list(evals)
    seeds = [str(i) for i in range(len(next(iter(evals.values()))))]
    sw = synthetic("st", {"seed": seeds, "loss": losses}, reference={"loss": losses[0]})
    for loss, values in evals.items():
        for seed, v in zip(seeds, values):
            dead = (loss, seed) in collapsed
            sw.run({"seed": seed, "loss": loss}, [0.4, 0.5, 0.0, 0.0] if dead else [0.4, 0.5, 0.5, 0.5],
                   eval_sampled=v, grad_norm=3.0 if loss == "grpo" else 1.0)
    return {"st": read_sweep(sw.dir)}


def _compare(b, expect, metric="eval_sampled"):
    return {"paper": "p", "sweep": "st", "metric": metric, "compare": {"a": {"loss": "vespo"}, "b": b},
            "expect": expect}


def _verdicts(tmp_path, sweeps, entries):
    return [v.verdict for v in cl.evaluate(_claims(tmp_path, entries), sweeps)]


def test_paired_rules(tmp_path, synthetic):
    # vespo - grpo = +0.05 on every seed; vespo - gspo = +0.02, -0.01, +0.03, -0.02, +0.01 (straddles 0)
    sweeps = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60, 0.45, 0.55], "grpo": [0.45, 0.35, 0.55, 0.40, 0.50],
                                "gspo": [0.48, 0.41, 0.57, 0.47, 0.54]})
    grpo, gspo = {"loss": "grpo"}, {"loss": "gspo"}
    assert _verdicts(tmp_path, sweeps, [
        _compare(grpo, "greater"), _compare(grpo, "less"), _compare(gspo, "greater"),
        _compare(gspo, {"within": 0.05}), _compare(grpo, {"within": 0.02}), _compare(gspo, {"within": 0.015}),
        _compare(gspo, {"at_least": -0.05}), _compare(grpo, {"at_least": 0.1}), _compare(grpo, "report"),
    ]) == ["agrees", "disagrees", "not resolved", "agrees", "disagrees", "not resolved", "agrees", "disagrees", "—"]


def test_a_claim_with_several_comparisons_agrees_only_if_all_do(tmp_path, synthetic):
    sweeps = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60], "grpo": [0.45, 0.35, 0.55],
                                "gspo": [0.48, 0.43, 0.57], "sapo": [0.60, 0.50, 0.70]})
    (v,) = cl.evaluate(_claims(tmp_path, [_compare([{"loss": "grpo"}, {"loss": "gspo"}], "greater")]), sweeps)
    assert v.verdict == "not resolved" and len(v.parts) == 2
    assert v.parts[0].startswith("vs loss=grpo: +0.050 [+0.050, +0.050], 3 seeds, higher in 3")
    assert _verdicts(tmp_path, sweeps, [_compare([{"loss": "grpo"}, {"loss": "sapo"}], "greater")]) == ["disagrees"]


def test_other_metrics(tmp_path, synthetic):
    sweeps = _sweep(synthetic, {"vespo": [0.5, 0.4, 0.6], "grpo": [0.5, 0.4, 0.6]})
    # synthetic max grad norm = grad_norm x 4 rows: vespo 4, grpo 12 on every seed
    assert _verdicts(tmp_path, sweeps, [_compare({"loss": "grpo"}, "less", metric="max_grad_norm")]) == ["agrees"]


def test_collapse_rules(tmp_path, synthetic):
    sweeps = _sweep(synthetic, {"vespo": [0.5] * 4, "sapo": [0.0, 0.0, 0.0, 0.4], "gspo": [0.4] * 4},
                    collapsed={("sapo", "0"), ("sapo", "1"), ("sapo", "2"), ("gspo", "3")})
    fires = {"sweep": "st", "where": {"loss": "sapo"}}  # a setting where the rule fired: a control
    entries = [{"paper": "p", "sweep": "st", "collapses": {"loss": loss}, "expect": expect,
                **({"control": fires} if expect == "none" else {})}
               for loss, expect in [("sapo", "most"), ("gspo", "most"), ("vespo", "most"), ("gspo", "some"),
                                    ("vespo", "some"), ("vespo", "none"), ("gspo", "none")]]
    verdicts = cl.evaluate(_claims(tmp_path, entries), sweeps)
    # vespo "most" with 0 of 4 collapsed: the exact interval [0, 0.53] still reaches one half
    assert [v.verdict for v in verdicts] == ["agrees", "partly", "too few seeds", "agrees", "not resolved", "agrees",
                                             "disagrees"]
    # from 5 runs on, none collapsing puts the rate below one half (0/5: [0, 0.45]): "most" disagrees
    assert [cl.collapse_verdict(0, n, "most") for n in (1, 4, 5, 10)] == ["too few seeds"] * 2 + ["disagrees"] * 2
    # 3 of 4: the exact 90% interval is [beta.ppf(0.05, 3, 2), beta.ppf(0.95, 4, 1)] = [0.249, 0.987]
    assert verdicts[0].measured == "3/4 runs collapsed (reward 3), rate 0.75 [0.25, 0.99]"
    assert verdicts[5].measured.endswith("control (st loss=sapo): 3/4 runs collapsed (reward 3), rate 0.75 [0.25, 0.99]")


def test_no_collapse_says_nothing_without_a_control_where_the_rule_fires(tmp_path, synthetic):
    sweeps = _sweep(synthetic, {"vespo": [0.5] * 3, "grpo": [0.5] * 3})
    with pytest.raises(cl.ClaimsError, match="claim 1: a 'none' collapse claim needs a control"):
        _claims(tmp_path, [{"paper": "p", "sweep": "st", "collapses": {"loss": "vespo"}, "expect": "none"}])
    quiet = {"paper": "p", "sweep": "st", "collapses": {"loss": "vespo"}, "expect": "none",
             "control": {"sweep": "st", "where": {"loss": "grpo"}}}  # grpo did not collapse either
    (v,) = cl.evaluate(_claims(tmp_path, [quiet]), sweeps)
    assert v.verdict == "not resolved" and v.measured.endswith("the rule fired in no control run, so 'no collapse' "
                                                               "says nothing")
    missing = {**quiet, "control": {"sweep": "lr_range", "where": {"lr": "1e-3"}}}
    (v,) = cl.evaluate(_claims(tmp_path, [missing]), sweeps)
    assert v.verdict == "not resolved" and "control (lr_range lr=1e-3) not run" in v.measured


def _staleness(synthetic, seeds=5):
    """loss x N x seeds; grpo loses 0.02 per doubling of N (plus seed noise); vespo flat; gspo = vespo."""
    sw = synthetic("st", {"seed": [str(s) for s in range(seeds)], "N": ["1", "8", "64"],
                          "loss": ["vespo", "grpo", "gspo"]}, reference={"loss": "vespo"})
    noise = [0.004, -0.003, 0.001, -0.002, 0.0, 0.003, -0.001]
    for s in range(seeds):
        for n in ("1", "8", "64"):
            doublings = {"1": 0, "8": 3, "64": 6}[n]
            base = 0.6 + 0.05 * s
            values = {"vespo": base + noise[(s + doublings) % 7], "grpo": base - 0.02 * doublings + noise[s],
                      "gspo": base + noise[(s + doublings) % 7]}
            for loss, v in values.items():
                sw.run({"seed": str(s), "N": n, "loss": loss}, [0.4, 0.5, 0.5, 0.5], n=int(n), eval_sampled=v)
    return {"st": read_sweep(sw.dir)}


def test_a_trend_over_n_is_the_slope_per_doubling_seed_by_seed(tmp_path, synthetic):
    sweeps = _staleness(synthetic)
    entries = [{"paper": "grpo weakens", "sweep": "st", "across": {"a": {"loss": "grpo"}, "over": "N"},
                "expect": "decreasing"},
               {"paper": "lead grows", "sweep": "st", "across": {"a": {"loss": "vespo"}, "b": {"loss": "grpo"},
                                                                  "over": "N"}, "expect": "increasing"},
               {"paper": "vespo flat", "sweep": "st", "across": {"a": {"loss": "vespo"}, "over": "N"},
                "expect": "decreasing"}]
    grpo, lead, flat = cl.evaluate(_claims(tmp_path, entries), sweeps)
    # grpo - its own value at N = 1 is exactly -0.06 at N = 8 and -0.12 at N = 64: the slope per doubling
    # (log2 N = 0, 3, 6) is -0.02 on every seed
    assert grpo.verdict == "agrees" and grpo.robustness == "robust"
    assert grpo.measured.startswith("eval_sampled, slope per doubling of N: -0.020 [-0.020, -0.020], 5 seeds")
    assert grpo.parts == ["N=8 minus N=1: -0.060 [-0.060, -0.060], 5 seeds, higher in 0",
                          "N=64 minus N=1: -0.120 [-0.120, -0.120], 5 seeds, higher in 0"]
    assert lead.verdict == "agrees" and lead.parts[0].startswith("N=1: ")
    assert flat.verdict in ("not resolved", "disagrees") and flat.robustness in ("unclear", "supported")


def test_across_judges_every_n_it_names(tmp_path, synthetic):
    sweeps = _staleness(synthetic)
    entries = [{"paper": "overlap", "sweep": "st", "across": {"a": {"loss": "vespo"}, "b": {"loss": "vespo", "N": "1"},
                                                              "over": "N"}, "expect": {"within": 0.02}},
               {"paper": "above", "sweep": "st", "across": {"a": {"loss": "vespo"}, "b": {"loss": "grpo"}, "over": "N",
                                                            "at": ["8", "64"]}, "expect": "greater"},
               {"paper": "above at 1 too", "sweep": "st", "across": {"a": {"loss": "vespo"}, "b": {"loss": "grpo"},
                                                                     "over": "N"}, "expect": "greater"}]
    overlap, above, everywhere = cl.evaluate(_claims(tmp_path, entries), sweeps)
    assert overlap.verdict == "agrees" and [x.split(":")[0] for x in overlap.parts] == ["N=8 vs N=1", "N=64 vs N=1"]
    # each seed's vespo(N) - vespo(1) is a few thousandths: all 5 inside the margin, at both N
    assert overlap.robustness == "robust"
    assert above.verdict == "agrees" and [x.split(":")[0] for x in above.parts] == ["N=8 vs loss=grpo",
                                                                                    "N=64 vs loss=grpo"]
    assert everywhere.verdict == "not resolved"  # at N = 1 vespo and grpo tie


def test_one_seed_is_too_few_seeds(tmp_path, synthetic):
    sweeps = _sweep(synthetic, {"vespo": [0.9], "grpo": [0.1]})
    (v,) = cl.evaluate(_claims(tmp_path, [_compare({"loss": "grpo"}, "greater")]), sweeps)
    assert v.verdict == "too few seeds" and v.robustness == "too few seeds"
    assert v.measured == "eval_sampled difference vs loss=grpo: +0.800 (one seed: no interval), 1 seeds, higher in 1"


def test_robustness_labels(tmp_path, synthetic):
    # vespo - grpo = +0.05 on 5 of 5 seeds: robust; vespo - gspo = +0.04, +0.03, +0.05, +0.06, -0.01: supported
    # (the interval excludes 0 but 4 of 5 agree, below 90%)
    sweeps = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60, 0.45, 0.55], "grpo": [0.45, 0.35, 0.55, 0.40, 0.50],
                                "gspo": [0.46, 0.37, 0.55, 0.39, 0.56]})
    robust, supported = cl.evaluate(_claims(tmp_path, [_compare({"loss": "grpo"}, "greater"),
                                                       _compare({"loss": "gspo"}, "greater")]), sweeps)
    assert (robust.verdict, robust.robustness) == ("agrees", "robust")
    assert (supported.verdict, supported.robustness) == ("agrees", "supported")


def test_lr_range_rule(tmp_path, synthetic):
    sw = synthetic("lr", {"seed": ["0", "1"], "lr": ["1e-4", "3e-4"], "loss": ["vespo", "grpo"]})
    for seed in "01":
        for label, lr in (("1e-4", 1e-4), ("3e-4", 3e-4)):
            sw.run({"seed": seed, "lr": label, "loss": "vespo"}, [0.4, 0.5, 0.5], lr=lr, eval_sampled=0.5)
            dead = label == "3e-4" and seed == "1"
            sw.run({"seed": seed, "lr": label, "loss": "grpo"}, [0.4, 0.5, 0.0, 0.0] if dead else [0.4, 0.5, 0.5, 0.5], lr=lr,
                   eval_sampled=0.5)
    sweeps = {"lr": read_sweep(sw.dir)}
    entries = [{"paper": "p", "sweep": "lr", "lr_range": {"loss": loss}, "expect": "widest"} for loss in ("vespo", "grpo")]
    verdicts = cl.evaluate(_claims(tmp_path, entries), sweeps)
    assert [v.verdict for v in verdicts] == ["agrees", "disagrees"]
    # vespo's claim holds whichever single run is flipped (at worst a tie, which still agrees); grpo's
    # disagreement rests on its seed 1 at 3e-4: without that collapse grpo ties vespo at 3x
    assert verdicts[0].measured == ("vespo: 3x (1e-4 to 3e-4); grpo: 1x (1e-4 to 1e-4); no single run's collapse "
                                    "changes it")
    assert [v.robustness for v in verdicts] == ["robust", "fragile"]


def test_a_sweep_that_was_not_run(tmp_path):
    (v,) = cl.evaluate(_claims(tmp_path, [_compare({"loss": "grpo"}, "greater")]), {})
    assert v.verdict == "not run" and v.measured == "sweep 'st' not run"


@pytest.mark.parametrize("entry, match", [
    ({"paper": "p", "sweep": "st", "expect": "greater"}, "exactly one of compare, across, collapses, lr_range"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}}, "expect": "greater"}, "compare must be"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": "bigger"}, "expect 'bigger' is not valid"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": {"within": -1}}, "within needs a margin"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "greater"}, "not valid for collapses"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "most", "metric": "speed"}, "metric 'speed' unknown"),
    ({"sweep": "st", "collapses": {}, "expect": "most"}, "missing 'paper'"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "most", "color": 1}, r"unknown key\(s\) \['color'\]"),
    ({"paper": "p", "sweep": "st", "across": {"a": {}}, "expect": "increasing"}, "across must be"),
    ({"paper": "p", "sweep": "st", "across": {"a": {}, "over": "N"}, "expect": "greater"}, "give b"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": "increasing"}, "not valid for compare"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": "greater",
      "control": {"sweep": "x", "where": {}}}, "control applies to collapses claims only"),
])
def test_malformed_claims_name_the_claim(tmp_path, entry, match):
    with pytest.raises(cl.ClaimsError, match=f"claims.yaml, claim 1: .*{match}"):
        _claims(tmp_path, [entry])


def test_a_selection_outside_the_grid_is_named(tmp_path, synthetic):
    sweeps = _sweep(synthetic, {"vespo": [0.5, 0.4], "grpo": [0.5, 0.4]})
    with pytest.raises(cl.ClaimsError, match=r"claim 1: sweep 'st': loss=\['sapo'\] not in the grid's values"):
        cl.evaluate(_claims(tmp_path, [_compare({"loss": "sapo"}, "greater")]), sweeps)


def test_the_shipped_claims_fit_the_shipped_sweep_files():
    records = {}
    for f in sorted(LAB.glob("*.yaml")):
        if f.name != "claims.yaml":
            s = load_sweep(f)
            records[s.name] = {"name": s.name, "axes": [{"label": a.label, "values": a.values} for a in s.axes]}
    claims = cl.load_claims(LAB / "claims.yaml")
    cl.check_claims(claims, records)  # raises ClaimsError naming the claim
    assert {c.sweep for c in claims.claims} == {"staleness", "lr_range", "lr_range_async", "length_norm", "asymmetry",
                                                "async", "mismatch", "mismatch_dense", "endpoint"}
    # every staleness claim is judged across N, not at one N alone
    assert {c.kind for c in claims.claims if c.sweep == "staleness" and c.kind != "collapses"} == {"across"}
    assert all(c.control for c in claims.claims if c.expect == "none")


def test_check_claims_finds_an_open_axis():
    records = {"st": {"name": "st", "axes": [{"label": "loss", "values": ["vespo", "grpo"]},
                                             {"label": "N", "values": ["1", "8"]}, {"label": "seed", "values": ["0"]}]}}
    claims = cl.Claims([cl.Claim("p", "st", "compare", {"a": {"loss": "vespo"}, "b": [{"loss": "grpo", "N": "8"}]},
                                 "greater", where="c 1")])
    with pytest.raises(cl.ClaimsError, match=r"c 1: compare.a \{'loss': 'vespo'\} leaves the axis/axes \['N'\] open"):
        cl.check_claims(claims, records)


def test_an_unfinished_lr_grid_decides_nothing(tmp_path, synthetic):
    """One seed of two has run: the ranges are printed, but more seeds can only narrow them."""
    sw = synthetic("lr", {"seed": ["0", "1"], "lr": ["1e-4", "3e-4"], "loss": ["vespo", "grpo"]})
    for label, lr in (("1e-4", 1e-4), ("3e-4", 3e-4)):
        for loss in ("vespo", "grpo"):
            sw.run({"seed": "0", "lr": label, "loss": loss}, [0.4, 0.5, 0.5], lr=lr, eval_sampled=0.5)
    entries = [{"paper": "p", "sweep": "lr", "lr_range": {"loss": "vespo"}, "expect": "widest"}]
    (v,) = cl.evaluate(_claims(tmp_path, entries), {"lr": read_sweep(sw.dir)})
    assert v.verdict == "not resolved"
    assert v.measured == ("vespo: 3x (1e-4 to 3e-4); grpo: 3x (1e-4 to 3e-4); 4 of 8 runs finished: "
                          "not decided until the sweep is complete")


def test_a_tied_lr_range_agrees_and_says_it_is_tied(tmp_path, synthetic):
    """'At least as wide as every other' holds on a tie; the measured text names who it ties with."""
    sw = synthetic("lr", {"seed": ["0"], "lr": ["1e-4", "3e-4"], "loss": ["vespo", "grpo", "sapo"]})
    for label, lr in (("1e-4", 1e-4), ("3e-4", 3e-4)):
        for loss in ("vespo", "grpo", "sapo"):
            dead = loss == "sapo" and label == "3e-4"
            sw.run({"seed": "0", "lr": label, "loss": loss}, [0.4, 0.5, 0.0, 0.0] if dead else [0.4, 0.5, 0.5, 0.5], lr=lr,
                   eval_sampled=0.5)
    entries = [{"paper": "p", "sweep": "lr", "lr_range": {"loss": "vespo"}, "expect": "widest"}]
    (v,) = cl.evaluate(_claims(tmp_path, entries), {"lr": read_sweep(sw.dir)})
    assert v.verdict == "agrees"
    assert v.measured == ("vespo: 3x (1e-4 to 3e-4); grpo: 3x (1e-4 to 3e-4); sapo: 1x (1e-4 to 1e-4); "
                          "no wider than (tied): grpo; one run's collapse decides it")  # grpo collapsing once
