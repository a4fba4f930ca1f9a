"""Collapse detection on synthetic curves: each rule fires when it should, and only then."""

import math

import pytest

from vespo.lab.collapse import Collapse, CollapseRule, collapse_of_rows, detect_collapse


def test_a_healthy_noisy_run_has_not_collapsed():
    rewards = [0.30, 0.35, 0.28, 0.40, 0.33, 0.45, 0.41]  # dips, but never below 0.5 x best
    assert detect_collapse(rewards, [0] * 7, [0.95] * 7) == Collapse(False)


def test_reward_falls_below_half_its_best_and_stays():
    # best so far: .4 .5 .5 .5 .5 ; 0.5 x best = .25 ; steps 3..5 (0.2, 0.1, 0.0) are below it
    rewards = [0.4, 0.5, 0.2, 0.1, 0.0]
    assert detect_collapse(rewards) == Collapse(True, "reward", 3)


def test_a_dip_that_recovers_is_not_a_collapse():
    rewards = [0.4, 0.5, 0.2, 0.1, 0.0, 0.3, 0.1, 0.1]  # recovers at step 6 (0.3 >= 0.25), falls again at 7
    # the last fall (steps 7, 8) lasts only 2 steps < patience 3
    assert detect_collapse(rewards, rule=CollapseRule(patience=3)) == Collapse(False)
    assert detect_collapse(rewards, rule=CollapseRule(patience=2)) == Collapse(True, "reward", 7)


def test_the_fall_must_last_until_the_end_for_patience_steps():
    rule = CollapseRule(patience=3)
    assert not detect_collapse([0.5, 0.5, 0.1, 0.1], rule=rule).collapsed  # 2 steps below
    assert detect_collapse([0.5, 0.5, 0.1, 0.1, 0.1], rule=rule) == Collapse(True, "reward", 3)


def test_patience_is_a_share_of_the_run_so_it_means_the_same_at_every_n():
    # 512 updates: 512 rows at N = 1, 8 rows at N = 64. The default asks for the last 10% of the rows
    # (ceil(0.1 x 512) = 52 rows = 52 updates at N = 1; ceil(0.1 x 8) = 1 row = 64 updates at N = 64).
    rule = CollapseRule()
    assert rule.steps_needed(512) == 52 and rule.steps_needed(8) == 1 and rule.steps_needed(40) == 4
    healthy = [0.5] * 460
    assert not detect_collapse(healthy + [0.1] * 51).collapsed  # 51 < 52 rows
    assert detect_collapse(healthy + [0.1] * 52) == Collapse(True, "reward", 461)
    assert detect_collapse([0.5] * 7 + [0.1]) == Collapse(True, "reward", 8)  # N = 64: its last rollout fell


def test_fraction_is_relative_to_the_best_so_far():
    # best 0.8 at step 2; 0.3 x 0.8 = 0.24: 0.3 is not below it, 0.2 is
    rule = CollapseRule(fraction=0.3)
    assert not detect_collapse([0.5, 0.8, 0.3, 0.3, 0.3], rule=rule).collapsed
    assert detect_collapse([0.5, 0.8, 0.2, 0.2, 0.2], rule=rule) == Collapse(True, "reward", 3)


def test_a_run_that_never_learned_cannot_fall():
    assert not detect_collapse([0.02, 0.0, 0.0, 0.0, 0.0]).collapsed  # best 0.02 < min_best 0.05


def test_skipped_updates_are_a_nonfinite_collapse_at_their_step():
    assert detect_collapse([0.4, 0.4, 0.4], skipped=[0, 2, 0]) == Collapse(True, "nonfinite", 2)


def test_a_nan_reward_or_a_run_stopped_for_nonfinite_updates_is_a_collapse():
    assert detect_collapse([0.4, math.nan, 0.4]) == Collapse(True, "nonfinite", 2)
    assert detect_collapse([0.4, 0.4], stopped_nonfinite=True) == Collapse(True, "nonfinite", 3)


def test_eos_rate_collapse_even_while_reward_holds():
    # responses stop ending from step 3 on; the reward has not fallen (yet)
    assert detect_collapse([0.4] * 6, [0] * 6, [0.9, 0.8, 0.4, 0.3, 0.1, 0.05]) == Collapse(True, "eos", 3)


def test_the_earliest_rule_is_reported():
    rewards = [0.5, 0.5, 0.1, 0.0, 0.0, 0.0]  # reward collapse from step 3
    eos = [1.0, 1.0, 1.0, 0.2, 0.1, 0.1]  # eos collapse from step 4
    assert detect_collapse(rewards, [0] * 6, eos) == Collapse(True, "reward", 3)
    assert detect_collapse(rewards, [0, 0, 0, 0, 0, 1], eos) == Collapse(True, "reward", 3)
    assert detect_collapse(rewards, [0, 1, 0, 0, 0, 0], eos) == Collapse(True, "nonfinite", 2)


def test_curves_of_different_lengths_are_rejected_by_name():
    with pytest.raises(ValueError, match="eos_rates has 2 steps but rewards has 3"):
        detect_collapse([0.1, 0.2, 0.3], eos_rates=[1.0, 1.0])


def test_bad_rule_values_are_rejected():
    with pytest.raises(ValueError, match="fraction"):
        CollapseRule(fraction=1.5)
    with pytest.raises(ValueError, match="patience"):
        CollapseRule(patience=0)
    with pytest.raises(ValueError, match="patience_share"):
        CollapseRule(patience_share=1.5)


def test_rows_of_a_metrics_file():
    rows = [{"step": i + 1, "reward/mean": r, "optim/n_skipped": 0.0, "rollout/eos_rate": 0.9}
            for i, r in enumerate([0.4, 0.5, 0.2, 0.1, 0.0])]
    assert collapse_of_rows(rows) == Collapse(True, "reward", 3)
    with pytest.raises(ValueError, match="row 1 .step 2. has no 'reward/mean'"):
        collapse_of_rows([rows[0], {"step": 2}])
