"""Claims against hand-made sweep directories: each judge gives agrees / disagrees / not resolved where
it should, the page's tests are corrected together (Holm), each verdict is read on three metrics, a
malformed claims file names the claim, and the shipped claims file fits the shipped sweep files."""

from pathlib import Path

import pytest
import yaml

from vespo.lab import claims as cl
from vespo.lab.grid import load_sweep
from vespo.lab.report import measured
from vespo.lab.runs import read_lab
from vespo.lab.stats import holm, p_value

LAB = Path(__file__).resolve().parents[2] / "configs" / "lab"


def _claims(tmp_path, entries, **extra):
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({"claims": entries, **extra}))
    return cl.load_claims(path)


def _sweep(synthetic, evals, collapsed=(), greedy=None):
    """evals: {loss: [held-out per seed]} (the last evaluation during training too, so the last-quarter mean
    reads the same); collapsed: set of (loss, seed); greedy: {loss: [greedy per seed]} (default: evals)."""
    losses = list(evals)
    seeds = [str(i) for i in range(len(next(iter(evals.values()))))]
    sw = synthetic("st", {"seed": seeds, "loss": losses}, reference={"loss": losses[0]})
    for loss, values in evals.items():
        for i, (seed, v) in enumerate(zip(seeds, values)):
            dead = (loss, seed) in collapsed
            rewards = [0.4, 0.5, 0.0, 0.0] if dead else [0.4, 0.5, 0.5, 0.5]
            sw.run({"seed": seed, "loss": loss}, rewards, eval_sampled=v, evals=rewards if dead else rewards[:3] + [v],
                   eval_greedy=(greedy or evals)[loss][i], grad_norm=3.0 if loss == "grpo" else 1.0)
    return read_lab([sw.dir])


def _compare(b, expect, metric="eval_sampled"):
    return {"paper": "p", "sweep": "st", "metric": metric, "compare": {"a": {"loss": "vespo"}, "b": b},
            "expect": expect}


def _judge(tmp_path, lab, entries):
    return cl.evaluate(_claims(tmp_path, entries), *lab)


def _verdict(tmp_path, lab, entry):
    (v,) = _judge(tmp_path, lab, [entry])  # one claim: a family of its own tests
    return v.verdict


def test_paired_rules(tmp_path, synthetic):
    # vespo - grpo = +0.05 on every seed (a zero-width interval: p = 0); vespo - gspo = +0.02, -0.01, +0.03,
    # -0.02, +0.01 (mean +0.006, straddles 0)
    lab = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60, 0.45, 0.55], "grpo": [0.45, 0.35, 0.55, 0.40, 0.50],
                             "gspo": [0.48, 0.41, 0.57, 0.47, 0.54]})
    grpo, gspo = {"loss": "grpo"}, {"loss": "gspo"}
    assert [_verdict(tmp_path, lab, e) for e in [
        _compare(grpo, "greater"), _compare(grpo, "less"), _compare(gspo, "greater"),
        _compare(gspo, {"within": 0.05}), _compare(grpo, {"within": 0.02}), _compare(gspo, {"within": 0.015}),
        _compare(gspo, {"at_least": -0.05}), _compare(grpo, {"at_least": 0.1}), _compare(grpo, "report"),
    ]] == ["agrees", "disagrees", "not resolved", "agrees", "disagrees", "not resolved", "agrees", "disagrees", "—"]


def test_a_claim_with_several_comparisons_agrees_only_if_all_do(tmp_path, synthetic):
    lab = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60], "grpo": [0.45, 0.35, 0.55],
                             "gspo": [0.48, 0.43, 0.57], "sapo": [0.60, 0.50, 0.70]})
    (v,) = _judge(tmp_path, lab, [_compare([{"loss": "grpo"}, {"loss": "gspo"}], "greater")])
    assert v.verdict == "not resolved" and len(v.readings["eval_sampled"]) == 2
    assert measured(v).startswith("eval_sampled difference: vs loss=grpo: +0.050 [+0.050, +0.050], 3 seeds, "
                                     "higher in 3 (Holm p 0.000)")
    assert _verdict(tmp_path, lab, _compare([{"loss": "grpo"}, {"loss": "sapo"}], "greater")) == "disagrees"


def test_the_pages_tests_are_one_family_under_holm(tmp_path, synthetic):
    """A difference whose 90% interval excludes 0 alone (p = 0.03) is resolved; beside nine claims that test
    nothing (p = 1) it is not: Holm multiplies the smallest p by the number of tests."""
    lab = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60, 0.45, 0.55], "grpo": [0.47, 0.35, 0.61, 0.41, 0.53],
                             "gspo": [0.50, 0.40, 0.60, 0.45, 0.55]})
    d = [0.03, 0.05, -0.01, 0.04, 0.02]
    assert 0.01 < p_value(d, 0.0) < 0.1
    (alone,) = _judge(tmp_path, lab, [_compare({"loss": "grpo"}, "greater")])
    many = _judge(tmp_path, lab, [_compare({"loss": "grpo"}, "greater")] + [_compare({"loss": "gspo"}, "greater")] * 9)
    assert alone.verdict == "agrees" and many[0].verdict == "not resolved"
    t = many[0].readings["eval_sampled"][0]
    assert t.adjusted == pytest.approx(holm([t.p] + [1.0] * 9)[0]) == pytest.approx(min(1.0, 10 * t.p))


@pytest.mark.parametrize("grpo_greedy", [[0.9, 0.8, 0.7], [0.85, 0.82, 0.6]])
def test_a_verdict_whose_readings_only_differ_in_what_resolves_says_where_it_holds(tmp_path, synthetic, grpo_greedy):
    """vespo above grpo on sampled accuracy (+0.05 on every seed, and so on the last-quarter mean); on greedy tied
    on every seed, or ahead on the mean without resolving: the readings do not disagree in sign, and the verdict
    says on which readings it holds."""
    lab = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60], "grpo": [0.45, 0.35, 0.55]},
                 greedy={"vespo": [0.9, 0.8, 0.7], "grpo": grpo_greedy})
    (v,) = _judge(tmp_path, lab, [_compare({"loss": "grpo"}, "greater")])
    greedy = v.readings["eval_greedy"][0].ci
    assert v.verdict == "agrees on held-out sampled and last-quarter mean only" and v.robustness == "unclear"
    assert measured(v).endswith(f"agrees on held-out sampled, but not resolved on greedy (vs loss=grpo "
                                f"{cl.ci_text(greedy, signed=True)}), on the same side of the line: it only "
                                "fails to resolve") and greedy.mean >= 0


def test_a_verdict_whose_readings_disagree_in_sign_depends_on_the_metric(tmp_path, synthetic):
    """vespo above grpo on sampled accuracy, below it on greedy's mean (-0.027, not resolved): the readings lie on
    two sides of the line, and the verdict depends on the metric, naming the test on the other side."""
    lab = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60], "grpo": [0.45, 0.35, 0.55]},
                 greedy={"vespo": [0.9, 0.8, 0.7], "grpo": [0.95, 0.78, 0.75]})
    (v,) = _judge(tmp_path, lab, [_compare({"loss": "grpo"}, "greater")])
    assert v.readings["eval_greedy"][0].ci.mean < 0
    assert v.verdict == "depends on the metric" and v.robustness == "unclear"
    assert measured(v).endswith("on the other side of the line in vs loss=grpo")


def test_other_metrics_have_one_reading(tmp_path, synthetic):
    lab = _sweep(synthetic, {"vespo": [0.5, 0.4, 0.6], "grpo": [0.5, 0.4, 0.6]})
    # synthetic max grad norm = grad_norm x 4 rows: vespo 4, grpo 12 on every seed
    (v,) = _judge(tmp_path, lab, [_compare({"loss": "grpo"}, "less", metric="max_grad_norm")])
    assert v.verdict == "agrees" and list(v.readings) == ["max_grad_norm"]


def test_collapse_rules(tmp_path, synthetic):
    lab = _sweep(synthetic, {"vespo": [0.5] * 4, "sapo": [0.0, 0.0, 0.0, 0.4], "gspo": [0.4] * 4},
                 collapsed={("sapo", "0"), ("sapo", "1"), ("sapo", "2"), ("gspo", "3")})
    fires = {"sweep": "st", "where": {"loss": "sapo"}}  # a setting where the rule fired: a control
    entries = [{"paper": "p", "sweep": "st", "collapses": {"loss": loss}, "expect": expect,
                **({"control": fires} if expect == "none" else {})}
               for loss, expect in [("sapo", "most"), ("gspo", "most"), ("vespo", "most"), ("gspo", "some"),
                                    ("vespo", "some"), ("vespo", "none"), ("gspo", "none")]]
    verdicts = _judge(tmp_path, lab, entries)
    # vespo "most" with 0 of 4 collapsed: the exact interval [0, 0.53] still reaches one half
    # vespo "none" with 0 of 4 collapsed does not agree: it bounds the rate, the exact one-sided 95% upper bound
    # 1 - 0.05^(1/4) (Clopper-Pearson with no event)
    bound = 1 - 0.05 ** (1 / 4)
    assert [v.verdict for v in verdicts] == ["agrees", "partly", "too few seeds", "agrees", "not resolved",
                                             f"rate at most {bound:.2f}", "disagrees"]
    assert f"no collapse bounds the rate: at most {bound:.2f} (one-sided 95%, exact)" in verdicts[5].text
    # 3 of 4: the exact 90% interval is [beta.ppf(0.05, 3, 2), beta.ppf(0.95, 4, 1)] = [0.249, 0.987]
    assert measured(verdicts[0]) == "3/4 runs collapsed (fell 3), rate 0.75 [0.25, 0.99]"
    assert verdicts[5].text.endswith("control (st loss=sapo): 3/4 runs collapsed (fell 3), rate 0.75 [0.25, 0.99]")


def test_no_collapse_says_nothing_without_a_control_where_the_rule_fires(tmp_path, synthetic):
    lab = _sweep(synthetic, {"vespo": [0.5] * 3, "grpo": [0.5] * 3})
    with pytest.raises(cl.ClaimsError, match="claim 1: collapses: .*a 'none' collapse claim needs a control"):
        _claims(tmp_path, [{"paper": "p", "sweep": "st", "collapses": {"loss": "vespo"}, "expect": "none"}])
    quiet = {"paper": "p", "sweep": "st", "collapses": {"loss": "vespo"}, "expect": "none",
             "control": {"sweep": "st", "where": {"loss": "grpo"}}}  # grpo did not collapse either
    (v,) = _judge(tmp_path, lab, [quiet])
    assert v.verdict == "not resolved" and v.text.endswith("the rule fired in no control run, so 'no collapse' says "
                                                           "nothing")
    (v,) = _judge(tmp_path, lab, [{**quiet, "control": {"sweep": "lr_range", "where": {"lr": "1e-3"}}}])
    assert v.verdict == "not resolved" and "control (lr_range lr=1e-3) not run" in v.text


def _staleness(synthetic, seeds=5):
    """loss x N x seeds; grpo loses 0.06 per step of N (plus seed noise); vespo flat; gspo = vespo."""
    sw = synthetic("st", {"seed": [str(s) for s in range(seeds)], "N": ["1", "8", "64"],
                          "loss": ["vespo", "grpo", "gspo"]}, reference={"loss": "vespo"})
    noise = [0.004, -0.003, 0.001, -0.002, 0.0, 0.003, -0.001]
    for s in range(seeds):
        for n in ("1", "8", "64"):
            step = {"1": 0, "8": 1, "64": 2}[n]
            base = 0.6 + 0.05 * s
            values = {"vespo": base + noise[(s + step) % 7], "grpo": base - 0.06 * step + noise[s],
                      "gspo": base + noise[(s + step) % 7]}
            for loss, v in values.items():
                sw.run({"seed": str(s), "N": n, "loss": loss}, [0.4, 0.5, 0.5, 0.5], n=int(n), eval_sampled=v,
                       evals=[0.4, 0.5, 0.5, v])
    return read_lab([sw.dir])


def test_a_trend_over_n_is_judged_at_every_step_of_n(tmp_path, synthetic):
    lab = _staleness(synthetic)
    entries = [{"paper": "grpo weakens", "sweep": "st", "across": {"a": {"loss": "grpo"}, "over": "N"},
                "expect": "decreasing"},
               {"paper": "lead grows", "sweep": "st", "across": {"a": {"loss": "vespo"}, "b": {"loss": "grpo"},
                                                                  "over": "N"}, "expect": "increasing"},
               {"paper": "vespo weakens", "sweep": "st", "across": {"a": {"loss": "vespo"}, "over": "N"},
                "expect": "decreasing"}]
    grpo, lead, flat = _judge(tmp_path, lab, entries)
    # grpo's value at each N minus at the N before is exactly -0.06 on every seed, at both steps
    assert grpo.verdict == "agrees" and grpo.robustness == "robust"
    assert [(t.name, t.text) for t in grpo.readings["eval_sampled"]] == [
        ("N=8 minus N=1", "-0.060 [-0.060, -0.060], 5 seeds, higher in 0"),
        ("N=64 minus N=8", "-0.060 [-0.060, -0.060], 5 seeds, higher in 0")]
    assert lead.verdict == "agrees"
    assert flat.verdict in ("not resolved", "disagrees")


def test_a_trend_that_holds_at_one_step_only_is_not_resolved(tmp_path, synthetic):
    """The rule gives N = 8 its weight: a fall from 8 to 64 with nothing from 1 to 8 does not agree."""
    sw = synthetic("st", {"seed": [str(s) for s in range(5)], "N": ["1", "8", "64"], "loss": ["grpo"]})
    for s in range(5):
        for n, v in (("1", 0.6), ("8", 0.6 + 0.01 * (s % 2 * 2 - 1)), ("64", 0.5)):
            sw.run({"seed": str(s), "N": n, "loss": "grpo"}, [0.4, 0.5, 0.5, 0.5], n=int(n), eval_sampled=v,
                   evals=[0.4, 0.5, 0.5, v])
    (v,) = _judge(tmp_path, read_lab([sw.dir]), [{"paper": "weakens", "sweep": "st", "expect": "decreasing",
                                                  "across": {"a": {"loss": "grpo"}, "over": "N"}}])
    assert v.verdict == "not resolved"
    assert [t.outcome for t in v.readings["eval_sampled"]] == ["not resolved", "agrees"]


def test_across_judges_every_n_it_names(tmp_path, synthetic):
    lab = _staleness(synthetic)
    entries = [{"paper": "overlap", "sweep": "st", "across": {"a": {"loss": "vespo"}, "b": {"loss": "vespo", "N": "1"},
                                                              "over": "N"}, "expect": {"within": 0.02}},
               {"paper": "above", "sweep": "st", "across": {"a": {"loss": "vespo"}, "b": {"loss": "grpo"}, "over": "N",
                                                            "at": ["8", "64"]}, "expect": "greater"},
               {"paper": "above at 1 too", "sweep": "st", "across": {"a": {"loss": "vespo"}, "b": {"loss": "grpo"},
                                                                     "over": "N"}, "expect": "greater"}]
    overlap, above, everywhere = _judge(tmp_path, lab, entries)
    assert overlap.verdict == "agrees" and [t.name for t in overlap.readings["eval_sampled"]] == ["N=8 vs N=1",
                                                                                                 "N=64 vs N=1"]
    assert overlap.robustness == "robust"  # each seed's vespo(N) - vespo(1) is a few thousandths
    assert above.verdict == "agrees" and [t.name for t in above.readings["eval_sampled"]] == ["N=8 vs loss=grpo",
                                                                                             "N=64 vs loss=grpo"]
    assert everywhere.verdict == "not resolved"  # at N = 1 vespo and grpo tie


def test_one_seed_is_too_few_seeds(tmp_path, synthetic):
    lab = _sweep(synthetic, {"vespo": [0.9], "grpo": [0.1]})
    (v,) = _judge(tmp_path, lab, [_compare({"loss": "grpo"}, "greater")])
    assert v.verdict == "too few seeds" and v.robustness == "too few seeds"
    assert measured(v) == "eval_sampled difference: vs loss=grpo: +0.800 (one seed), higher in 1"


def test_robustness_labels(tmp_path, synthetic):
    # vespo - grpo = +0.05 on 5 of 5 seeds: robust; vespo - gspo = +0.04, +0.03, +0.05, +0.06, -0.01: the seeds
    # do not agree closely enough (4 of 5) for robust
    lab = _sweep(synthetic, {"vespo": [0.50, 0.40, 0.60, 0.45, 0.55], "grpo": [0.45, 0.35, 0.55, 0.40, 0.50],
                             "gspo": [0.46, 0.37, 0.55, 0.39, 0.56]})
    (robust,) = _judge(tmp_path, lab, [_compare({"loss": "grpo"}, "greater")])
    (other,) = _judge(tmp_path, lab, [_compare({"loss": "gspo"}, "greater")])
    assert (robust.verdict, robust.robustness) == ("agrees", "robust")
    assert other.robustness in ("supported", "unclear")


def test_stabler_pairs_collapses_by_seed_and_learning_rate(tmp_path, synthetic):
    """grpo collapses at the top two lrs on every seed, vespo at the top one: one run per seed where grpo
    alone collapsed, none the other way; McNemar's exact p = 2 x 0.5^4 = 0.125 on 4 seeds (not resolved),
    2 x 0.5^6 = 0.031 on 6 (agrees)."""
    def lab(seeds):
        sw = synthetic(f"lr{seeds}", {"seed": [str(s) for s in range(seeds)], "lr": ["1e-4", "3e-4", "1e-3"],
                                      "loss": ["vespo", "grpo"]})
        for s in range(seeds):
            for label, lr in (("1e-4", 1e-4), ("3e-4", 3e-4), ("1e-3", 1e-3)):
                for loss in ("vespo", "grpo"):
                    dead = label == "1e-3" or (loss == "grpo" and label == "3e-4")
                    sw.run({"seed": str(s), "lr": label, "loss": loss}, [0.4, 0.5, 0.0, 0.0] if dead else
                           [0.4, 0.5, 0.5, 0.5], lr=lr, eval_sampled=0.0 if dead else 0.5)
        return read_lab([sw.dir])

    entry = lambda name: {"paper": "p", "sweep": name, "stabler": {"a": {"loss": "vespo"}, "b": {"loss": "grpo"}},  # noqa
                          "expect": "greater"}
    (four,) = _judge(tmp_path, lab(4), [entry("lr4")])
    (six,) = _judge(tmp_path, lab(6), [entry("lr6")])
    assert four.verdict == "not resolved" and six.verdict == "agrees"
    t = six.readings["collapsed"][0]
    assert (t.n, t.p) == (18, pytest.approx(2 * 0.5 ** 6))
    assert t.text == "18 runs paired by seed and lr: collapsed where the other did not 0 vs 6"


def test_a_sweep_that_was_not_run(tmp_path, synthetic):
    lab = _sweep(synthetic, {"vespo": [0.5, 0.4], "grpo": [0.5, 0.4]})
    entry = {**_compare({"loss": "grpo"}, "greater"), "sweep": "other"}
    (v,) = cl.evaluate(_claims(tmp_path, [entry]), *lab)
    assert v.verdict == "not run" and measured(v) == "sweep 'other' not run"


@pytest.mark.parametrize("entry, match", [
    ({"paper": "p", "sweep": "st", "expect": "greater"}, "exactly one of compare, across, stabler, collapses"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}}, "expect": "greater"}, "compare: b: Field required"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": "bigger"}, "expect 'bigger' is not valid"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": {"within": -1}}, "within: margin > 0"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "greater"}, "not valid for collapses"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "most", "metric": "speed"}, "metric: Input should be 'eval_sampled', 'eval_greedy'"),
    ({"sweep": "st", "collapses": {}, "expect": "most"}, "paper: Field required"),
    ({"paper": "p", "sweep": "st", "collapses": {}, "expect": "most", "color": 1}, "color: Extra inputs"),
    ({"paper": "p", "sweep": "st", "across": {"a": {}}, "expect": "increasing"}, "over: Field required"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": "increasing"}, "not valid for compare"),
    ({"paper": "p", "sweep": "st", "compare": {"a": {}, "b": {}}, "expect": "greater",
      "control": {"sweep": "x", "where": {}}}, "control: Extra inputs"),
])
def test_malformed_claims_name_the_claim(tmp_path, entry, match):
    with pytest.raises(cl.ClaimsError, match=f"claims.yaml, claim 1: .*{match}"):
        _claims(tmp_path, [entry])


def test_a_selection_outside_the_grid_is_named(tmp_path, synthetic):
    lab = _sweep(synthetic, {"vespo": [0.5, 0.4], "grpo": [0.5, 0.4]})
    with pytest.raises(cl.ClaimsError, match=r"claim 1: sweep 'st': loss=\['sapo'\] is not on the grid"):
        _judge(tmp_path, lab, [_compare({"loss": "sapo"}, "greater")])


def test_the_shipped_claims_fit_the_shipped_sweep_files():
    sweeps = {s.name: s for s in (load_sweep(f) for f in sorted(LAB.glob("*.yaml")) if f.name != "claims.yaml")}
    claims = cl.load_claims(LAB / "claims.yaml")
    cl.check_claims(claims, sweeps)  # raises ClaimsError naming the claim
    assert {c.sweep for c in claims.claims} >= {"staleness", "lr_range", "lr_range_async", "length_norm", "asymmetry",
                                                "async", "mismatch", "mismatch_dense", "endpoint"}
    # every staleness claim is judged across N, not at one N alone; an lr claim leaves step-size variants out
    assert {type(c).__name__ for c in claims.claims if c.sweep == "staleness" and not isinstance(c, cl.Collapses)} \
        == {"Across"}
    assert all(c.control for c in claims.claims if c.kind == "none")
    assert all("ess_lr" not in str(c.b) for c in claims.claims if isinstance(c, cl.Stabler))


def test_check_claims_finds_an_open_axis(tmp_path):
    sweep = load_sweep(_write(tmp_path, {"name": "st", "grid": {"loss.name": ["vespo", "grpo"], "staleness.n": [1, 8],
                                                                "run.seed": [0]}}))
    claims = _claims(tmp_path, [{"paper": "p", "sweep": "st", "expect": "greater",
                                 "compare": {"a": {"loss": "vespo"}, "b": {"loss": "grpo", "N": "8"}}}])
    with pytest.raises(cl.ClaimsError, match=r"claim 1: sweep 'st': \{'loss': 'vespo'\} leaves the axis/axes \['N'\]"):
        cl.check_claims(claims, {"st": sweep})


def _write(tmp_path, data):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
