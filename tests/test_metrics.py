"""The trainer's one reduction of a step's metrics: by name, and statistics over their counts."""

import math

import torch

from vespo.metrics import Reduction, reduce_metrics, reduction


def test_reduction_by_name_by_hand():
    pieces = [{"is/log_w_max": 0.5, "is/log_w_min": -1.0, "optim/n_skipped": 1.0, "loss/total": 2.0,
               "perf/update_s_sum": 0.25},
              {"is/log_w_max": 2.0, "is/log_w_min": -0.5, "optim/n_skipped": 0.0, "loss/total": 4.0,
               "perf/update_s_sum": 0.5}]
    out = reduce_metrics(pieces)
    assert out == {"is/log_w_max": 2.0, "is/log_w_min": -1.0, "optim/n_skipped": 1.0, "loss/total": 3.0,
                   "perf/update_s_sum": 0.75}


def test_statistics_skip_empty_selections_and_weight_means_by_their_counts():
    # micro-batch 1: 3 rows with A >= 0 (phi mean 0.9), none with A < 0 (its statistics read 0);
    # micro-batch 2: 1 row with A >= 0 (phi 0.5), 2 with A < 0 (phi mean 0.2, min 0.1)
    a = {"vespo/n_pos": 3.0, "vespo/phi_pos_mean": 0.9, "vespo/phi_pos_min": 0.8,
         "vespo/n_neg": 0.0, "vespo/phi_neg_mean": 0.0, "vespo/phi_neg_min": 0.0, "vespo/phi_neg_max": 0.0}
    b = {"vespo/n_pos": 1.0, "vespo/phi_pos_mean": 0.5, "vespo/phi_pos_min": 0.5,
         "vespo/n_neg": 2.0, "vespo/phi_neg_mean": 0.2, "vespo/phi_neg_min": 0.1, "vespo/phi_neg_max": 0.3}
    out = reduce_metrics([a, b])
    assert out["vespo/n_pos"] == 4.0 and out["vespo/n_neg"] == 2.0
    assert math.isclose(out["vespo/phi_pos_mean"], (3 * 0.9 + 1 * 0.5) / 4)  # the mean over all 4 rows
    assert out["vespo/phi_pos_min"] == 0.5
    assert (out["vespo/phi_neg_mean"], out["vespo/phi_neg_min"], out["vespo/phi_neg_max"]) == (0.2, 0.1, 0.3)


def test_tensors_reduce_without_changing_kind_and_missing_keys_use_the_pieces_that_have_them():
    out = reduce_metrics([{"kl/k3": torch.tensor(1.0), "reward/mean": 0.5}, {"kl/k3": torch.tensor(3.0)}])
    assert isinstance(out["kl/k3"], torch.Tensor) and float(out["kl/k3"]) == 2.0
    assert out["reward/mean"] == 0.5


def test_each_name_declares_its_reduction():
    cases = {"is/log_w_max": Reduction("max", "is/n_seq"), "vespo/phi_neg_min": Reduction("min", "vespo/n_neg"),
             "vespo/eq_w_pos": Reduction("mean", "vespo/n_pos"), "is/ess": Reduction("mean", "is/n_seq"),
             "vespo/log_w_p90": Reduction("mean", "is/n_seq"), "vespo/w_ess": Reduction("mean", "is/n_seq"),
             "is/n_seq": Reduction("sum", None), "vespo/n_pos": Reduction("sum", None),
             "rollout/n_tokens": Reduction("sum", None), "perf/update_s_sum": Reduction("sum", None),
             "vespo/phi_pos_sum": Reduction("sum", "vespo/n_pos"), "optim/grad_norm_max": Reduction("max", None),
             "loss/total": Reduction("mean", None), "kl/k3": Reduction("mean", None),
             "loss/clip_frac_high": Reduction("mean", None), "vespo/lambda_pos": Reduction("mean", "vespo/n_pos"),
             "vespo/adapted_neg": Reduction("mean", "vespo/n_neg")}
    assert {name: reduction(name) for name in cases} == cases


def test_behavior_rows_select_padding_out():
    """NaN / -inf on padding (an engine that does not score a position) reaches no mismatch statistic: the
    rows equal those of the same batch with zeros there."""
    from vespo.metrics import behavior_rows, summarize_behavior

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
    rollout, train, entropy = (-torch.rand(2, 4, generator=g) for _ in range(3))
    clean = behavior_rows(rollout * mask, train * mask, entropy * mask, mask)
    for fill in (float("nan"), -float("inf")):
        pad = mask == 0
        rows = behavior_rows(rollout.masked_fill(pad, fill), train.masked_fill(pad, fill),
                             entropy.masked_fill(pad, fill), mask)
        assert all(torch.equal(rows[k], clean[k]) for k in clean), fill
        assert all(math.isfinite(v) for v in summarize_behavior(rows).values())
