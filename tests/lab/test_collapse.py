"""Collapse detection: each rule fires when it should and only then, on evidence taken after the same
optimizer steps at every N; and its simulated false-positive rate and power."""

import math

import pytest

from vespo.lab import simulate
from vespo.lab.collapse import Collapse, CollapseRule, collapse_of_rows, describe, detect_collapse, evidence_of_rows


def test_a_healthy_noisy_run_has_not_collapsed():
    rewards = [0.30, 0.35, 0.28, 0.40, 0.33, 0.45, 0.41]  # dips, but never below 0.5 x best
    assert detect_collapse(rewards, [0] * 7, [0.95] * 7) == Collapse(False)


def test_reward_falls_below_half_its_best_and_stays():
    # best so far: .4 .5 .5 .5 .5 ; 0.5 x best = .25 ; points 3..5 (0.2, 0.1, 0.0) are below it
    rewards = [0.4, 0.5, 0.2, 0.1, 0.0]
    assert detect_collapse(rewards) == Collapse(True, "reward", 3)


def test_a_dip_that_recovers_is_not_a_collapse():
    rewards = [0.4, 0.5, 0.2, 0.1, 0.0, 0.3, 0.1, 0.1]  # recovers at point 6 (0.3 >= 0.25), falls again at 7
    # the last fall (points 7, 8) lasts only 2 points < patience 3
    assert detect_collapse(rewards, rule=CollapseRule(patience=3)) == Collapse(False)
    assert detect_collapse(rewards, rule=CollapseRule(patience=2)) == Collapse(True, "reward", 7)


def test_one_fallen_point_at_the_end_is_not_enough():
    """The default asks for two evaluations (64 updates apart in the lab) below half the best."""
    assert detect_collapse([0.5] * 7 + [0.1]) == Collapse(False)
    assert detect_collapse([0.5] * 6 + [0.1, 0.1]) == Collapse(True, "reward", 7)


def test_patience_is_points_and_a_share_of_them():
    # 8 points (512 updates every 64): max(2, ceil(0.8)) = 2; 32 points (2048 updates): ceil(3.2) = 4
    rule = CollapseRule()
    assert rule.points_needed(8) == 2 and rule.points_needed(32) == 4 and rule.points_needed(4) == 2
    assert not detect_collapse([0.5] * 29 + [0.1] * 3).collapsed
    assert detect_collapse([0.5] * 28 + [0.1] * 4) == Collapse(True, "reward", 29)


def test_the_evaluation_before_training_counts_in_the_best():
    # a run that fell from 0.4 (before training) to 0.1 in its first 64 updates and never rose again
    assert detect_collapse([0.1, 0.1, 0.1], start=0.4) == Collapse(True, "reward", 1)
    assert not detect_collapse([0.1, 0.1, 0.1]).collapsed


def test_fraction_is_relative_to_the_best_so_far():
    # best 0.8 at point 2; 0.3 x 0.8 = 0.24: 0.3 is not below it, 0.2 is
    rule = CollapseRule(fraction=0.3)
    assert not detect_collapse([0.5, 0.8, 0.3, 0.3, 0.3], rule=rule).collapsed
    assert detect_collapse([0.5, 0.8, 0.2, 0.2, 0.2], rule=rule) == Collapse(True, "reward", 3)


def test_a_run_that_never_learned_cannot_fall():
    assert not detect_collapse([0.02, 0.0, 0.0, 0.0, 0.0]).collapsed  # best 0.02 < min_best 0.05


def test_skipped_updates_are_a_nonfinite_collapse_at_their_point():
    assert detect_collapse([0.4, 0.4, 0.4], skipped=[0, 2, 0]) == Collapse(True, "nonfinite", 2)


def test_a_nan_reward_or_a_run_stopped_for_nonfinite_updates_is_a_collapse():
    assert detect_collapse([0.4, math.nan, 0.4]) == Collapse(True, "nonfinite", 2)
    assert detect_collapse([0.4, 0.4], stopped_nonfinite=True) == Collapse(True, "nonfinite", 3)


def test_eos_rate_collapse_even_while_reward_holds():
    # responses stop ending from point 3 on; the reward has not fallen (yet)
    assert detect_collapse([0.4] * 6, [0] * 6, [0.9, 0.8, 0.4, 0.3, 0.1, 0.05]) == Collapse(True, "eos", 3)


def test_the_earliest_rule_is_reported():
    rewards = [0.5, 0.5, 0.1, 0.0, 0.0, 0.0]  # reward collapse from point 3
    eos = [1.0, 1.0, 1.0, 0.2, 0.1, 0.1]  # eos collapse from point 4
    assert detect_collapse(rewards, [0] * 6, eos) == Collapse(True, "reward", 3)
    assert detect_collapse(rewards, [0, 0, 0, 0, 0, 1], eos) == Collapse(True, "reward", 3)
    assert detect_collapse(rewards, [0, 1, 0, 0, 0, 0], eos) == Collapse(True, "nonfinite", 2)


def test_curves_of_different_lengths_are_rejected_by_name():
    with pytest.raises(ValueError, match="eos_rates has 2 points but rewards has 3"):
        detect_collapse([0.1, 0.2, 0.3], eos_rates=[1.0, 1.0])


def test_bad_rule_values_are_rejected():
    with pytest.raises(ValueError, match="fraction"):
        CollapseRule(fraction=1.5)
    with pytest.raises(ValueError, match="patience"):
        CollapseRule(patience=0)
    with pytest.raises(ValueError, match="patience_share"):
        CollapseRule(patience_share=1.5)
    with pytest.raises(ValueError, match="every"):
        CollapseRule(every=0)


# ---------------------------------------------------------------- the evidence of a run


def _rows(rewards, n, evals=None, eos=None):
    """Rows of a run at N = n: row k trained updates (k-1) n .. k n - 1; evals[k-1] evaluated after them."""
    return [{"step": k + 1, "reward/mean": r, "optim/n_skipped": 0.0, "rollout/eos_rate": 1.0 if eos is None else eos[k],
             **({"eval/reward_sampled": evals[k]} if evals is not None and evals[k] is not None else {})}
            for k, r in enumerate(rewards)]


def test_held_out_evaluations_are_the_same_points_at_every_n():
    """A run at N = 1 (512 rows) and one at N = 64 (8 rows), both evaluated every 64 updates, are judged
    on the same 8 points after the same updates; the training rows do not enter."""
    curve = [0.5, 0.6, 0.6, 0.7, 0.7, 0.3, 0.2, 0.1]  # held-out after 64, 128, ..., 512 updates
    n1 = _rows([0.9] * 512, 1, evals=[curve[u // 64 - 1] if u % 64 == 0 else None for u in range(1, 513)])
    n64 = _rows([0.9] * 8, 64, evals=curve)
    for rows, n in ((n1, 1), (n64, 64)):
        ev = evidence_of_rows(rows, n, before=0.3)
        assert ev.source == "held-out" and ev.updates == [64 * k for k in range(1, 9)] and ev.rewards == curve
        # best 0.7; below 0.35 from the point after 384 updates (0.3) through the end
        assert collapse_of_rows(rows, n, before=0.3) == Collapse(True, "reward", 6, 384, "held-out")


def test_without_evaluations_the_training_reward_in_windows_of_64_updates_decides():
    """Windows of 64 updates hold the same samples at every N: 64 rows at N = 1, one row at N = 64."""
    per_window = [0.5, 0.6, 0.6, 0.7, 0.7, 0.3, 0.2, 0.1]
    n1 = _rows([per_window[k // 64] for k in range(512)], 1)
    n8 = _rows([per_window[k // 8] for k in range(64)], 8)
    n64 = _rows(per_window, 64)
    for rows, n in ((n1, 1), (n8, 8), (n64, 64)):
        ev = evidence_of_rows(rows, n)
        assert ev.source == "train" and ev.updates == [64 * k for k in range(1, 9)]
        assert ev.rewards == pytest.approx(per_window)
        assert collapse_of_rows(rows, n) == Collapse(True, "reward", 6, 384, "train")


def test_eos_and_skipped_updates_are_read_over_the_same_windows():
    eos = [1.0] * 448 + [0.2] * 64  # responses stop ending in the last 64 updates only: one window
    assert evidence_of_rows(_rows([0.5] * 512, 1, eos=eos), 1).eos == pytest.approx([1.0] * 7 + [0.2])
    assert not collapse_of_rows(_rows([0.5] * 512, 1, eos=eos), 1).collapsed
    eos = [1.0] * 384 + [0.2] * 128  # the last two windows
    assert collapse_of_rows(_rows([0.5] * 512, 1, eos=eos), 1) == Collapse(True, "eos", 7, 448, "train")
    rows = _rows([0.5] * 64, 8)
    rows[20]["optim/n_skipped"] = 1.0  # the row trained in updates 160..167: window 3 (128, 192]
    assert collapse_of_rows(rows, 8) == Collapse(True, "nonfinite", 3, 192, "train")


def test_rows_without_a_reward_are_named():
    with pytest.raises(ValueError, match="row 1 .step 2. has no 'reward/mean'"):
        collapse_of_rows([{"step": 1, "reward/mean": 0.4}, {"step": 2}])


def test_the_rule_in_words_comes_from_its_fields():
    text = describe(CollapseRule(fraction=0.3, patience=3, every=32))
    assert "below 0.3 x its best" in text and "at least 3 evaluations" in text and "windows of 32 updates" in text


# ---------------------------------------------------------------- simulated runs


def test_simulated_false_positives_and_power():
    """On simulated runs (vespo.lab.simulate) the rule flags no stable run and no dip that recovers on
    held-out evidence, and catches nearly every run that falls to a third of its accuracy."""
    rates = {(r.scenario, r.evidence): r.flagged for r in simulate.collapse_rates(runs=300, ns=(1, 64))}
    for scenario in simulate.SCENARIOS:
        caught = rates[(scenario, "held-out")]
        if scenario.startswith("collapse"):
            assert caught > 0.95, (scenario, caught)
        else:
            assert caught < 0.01, (scenario, caught)
    assert rates[("collapse to a third", "train, N = 1")] > 0.95 and rates[("collapse to a third", "train, N = 64")] > 0.95
    assert rates[("stable, calm (wobble 0.3)", "train, N = 64")] < 0.01


def test_the_old_false_positive_is_not_a_collapse():
    """The lr-range run (N = 32, 256 updates, 8 rows) the row-based rule called collapsed: its last
    rollout batch's training reward fell below half the best row, yet its held-out accuracy after
    training, 0.551, was the best of its cell. Judged on held-out evaluations every 64 updates (the
    last one after the final update), or on 64-update windows of training reward, it has not."""
    train = [0.40, 0.50, 0.60, 0.62, 0.60, 0.58, 0.61, 0.25]  # row 8 < 0.5 x 0.62: the old rule fired here
    evals = [None, 0.45, None, 0.52, None, 0.55, None, 0.551]  # after updates 64, 128, 192, 256
    assert not collapse_of_rows(_rows(train, 32, evals=evals), 32, before=0.30).collapsed
    assert evidence_of_rows(_rows(train, 32), 32).rewards == pytest.approx([0.45, 0.61, 0.59, 0.43])
    assert not collapse_of_rows(_rows(train, 32), 32).collapsed
