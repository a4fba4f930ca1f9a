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
    entries = [{"paper": "p", "sweep": "st", "collapses": {"loss": loss}, "expect": expect}
               for loss, expect in [("sapo", "most"), ("gspo", "most"), ("vespo", "most"), ("gspo", "some"),
                                    ("vespo", "some"), ("vespo", "none"), ("gspo", "none")]]
    verdicts = cl.evaluate(_claims(tmp_path, entries), sweeps)
    assert [v.verdict for v in verdicts] == ["agrees", "partly", "disagrees", "agrees", "not resolved", "agrees",
                                             "disagrees"]
    assert verdicts[0].measured == "3/4 runs collapsed (reward 3)"


def test_lr_range_rule(tmp_path, synthetic):
    sw = synthetic("lr", {"seed": ["0", "1"], "lr": ["1e-4", "3e-4"], "loss": ["vespo", "grpo"]})
    for seed in "01":
        for label, lr in (("1e-4", 1e-4), ("3e-4", 3e-4)):
            sw.run({"seed": seed, "lr": label, "loss": "vespo"}, [0.4, 0.5, 0.5], lr=lr, eval_sampled=0.5)
            dead = label == "3e-4" and seed == "1"
            sw.run({"seed": seed, "lr": label, "loss": "grpo"}, [0.4, 0.5, 0.0] if dead else [0.4, 0.5, 0.5], lr=lr,
                   eval_sampled=0.5)
    sweeps = {"lr": read_sweep(sw.dir)}
    entries = [{"paper": "p", "sweep": "lr", "lr_range": {"loss": loss}, "expect": "widest"} for loss in ("vespo", "grpo")]
    verdicts = cl.evaluate(_claims(tmp_path, entries), sweeps)
    assert [v.verdict for v in verdicts] == ["agrees", "disagrees"]
    assert verdicts[0].measured == "vespo: 3x (1e-4 to 3e-4); grpo: 1x (1e-4 to 1e-4)"


def test_a_sweep_that_was_not_run(tmp_path):
    (v,) = cl.evaluate(_claims(tmp_path, [_compare({"loss": "grpo"}, "greater")]), {})
    assert v.verdict == "not run" and v.measured == "sweep 'st' not run"


@pytest.mark.parametrize("entry, match", [
    ({"paper": "p", "sweep": "st", "expect": "greater"}, "exactly one of compare, collapses, lr_range"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}}, "expect": "greater"}, "compare must be"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": "bigger"}, "expect 'bigger' is not valid"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": {"within": -1}}, "within needs a margin"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "greater"}, "not valid for collapses"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "most", "metric": "speed"}, "metric 'speed' unknown"),
    ({"sweep": "st", "collapses": {}, "expect": "most"}, "missing 'paper'"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "most", "color": 1}, r"unknown key\(s\) \['color'\]"),
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
                                                "async", "mismatch", "mismatch_dense"}


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
            sw.run({"seed": "0", "lr": label, "loss": loss}, [0.4, 0.5, 0.0] if dead else [0.4, 0.5, 0.5], lr=lr,
                   eval_sampled=0.5)
    entries = [{"paper": "p", "sweep": "lr", "lr_range": {"loss": "vespo"}, "expect": "widest"}]
    (v,) = cl.evaluate(_claims(tmp_path, entries), {"lr": read_sweep(sw.dir)})
    assert v.verdict == "agrees"
    assert v.measured == ("vespo: 3x (1e-4 to 3e-4); grpo: 3x (1e-4 to 3e-4); sapo: 1x (1e-4 to 1e-4); "
                          "no wider than (tied): grpo")
