"""The recommendation from hand-made sweeps: paired on common seeds, nothing picked among identical
updates or ties, a loss ahead of another never listed as tied with it, each line with its budget."""

from vespo.lab.recommend import pick, recommendation_markdown
from vespo.lab.runs import read_lab


def _runs(synthetic, finals, name="s"):
    """finals: {loss: {seed: held-out}}; every run the same curve unless its final differs."""
    seeds = sorted({s for v in finals.values() for s in v})
    sw = synthetic(name, {"seed": seeds, "loss": list(finals)})
    for loss, by in finals.items():
        for seed, v in by.items():
            sw.run({"seed": seed, "loss": loss}, [0.5] * 4, eval_sampled=v, steps=4)  # settled curves
    return read_lab([sw.dir])[1]


def _line(p):
    return recommendation_markdown([p]).splitlines()[2]


def test_identical_updates_pick_nothing(synthetic):
    same = {str(s): 0.5 + 0.02 * s for s in range(5)}
    p = pick("sync", "N = 1", _runs(synthetic, {"vespo": same, "grpo": same, "dppo_kl": dict(list(same.items())[:3])}),
             "loss")
    assert p.named is None and p.groups == [["vespo", "grpo", "dppo_kl"]]
    assert _line(p) == ("- N = 1, held-out sampled accuracy after 4 updates: the evidence picks none; identical updates: "
                        "VESPO = GRPO = DPPO-KL; curves at this budget: 3 of 3 settled, 0 still rising")


def test_a_loss_is_named_only_when_it_is_ahead_of_every_other(synthetic):
    a = {str(s): 0.5 + 0.03 * s for s in range(6)}
    runs = _runs(synthetic, {"vespo": a, "grpo": {s: v - 0.05 for s, v in a.items()},
                             "sapo": {s: v - 0.05 + (0.06 if int(s) % 2 else -0.06) for s, v in a.items()}})
    p = pick("sync", "", runs, "loss")
    # vespo is ahead of grpo (-0.05 on every seed) but not of sapo (+-0.06 around grpo): nothing is named
    assert p.named is None and [p.groups[i] for i in p.top] == [["vespo"], ["sapo"]]
    assert _line(p) == ("- held-out sampled accuracy after 4 updates: the evidence picks none; tied: VESPO, SAPO; GRPO "
                        "behind VESPO by +0.050 [+0.050, +0.050], higher in 6/6 seeds (robust); curves at this budget: "
                        "3 of 3 settled, 0 still rising")
    alone = pick("sync", "", runs[runs.loss != "sapo"], "loss")
    assert alone.named == "vespo"
    assert _line(alone).startswith("- held-out sampled accuracy after 4 updates: use **VESPO** (held-out 0.575 [")


def test_means_over_different_seed_sets_do_not_rank(synthetic):
    """gspo ran the 5 seeds that score high; on those seeds it is below vespo on every one: a ranking by
    means would put it first, the paired comparison puts it behind."""
    vespo = {str(s): (0.8 if s < 5 else 0.6) + 0.01 * s for s in range(10)}
    gspo = {s: v - 0.02 for s, v in vespo.items() if int(s) < 5}
    p = pick("sync", "", _runs(synthetic, {"vespo": vespo, "gspo": gspo}), "loss")
    assert sum(gspo.values()) / 5 > sum(vespo.values()) / 10
    assert p.named == "vespo" and "GSPO behind VESPO by +0.020 [+0.020, +0.020], higher in 5/5 seeds" in _line(p)
