"""What computing a batch statistic per call costs: M2PO's second-moment mask and adaptive VESPO's kernel shape
on each micro-batch (or rank) instead of on the whole mini-batch, measured on real stale mini-batches.

    OMP_NUM_THREADS=1 python bench/batch_statistics.py [--base configs/lab/bases/reverse16.yaml] [--n 8]
        [--updates 64] [--seeds 0 1] [--parts 2 4 8] [--out runs/batch_statistics]

Trains each loss (m2po, vespo_adaptive) for ``--updates`` optimizer steps at staleness N on the lab's base
setting, recording every loss call's inputs (the whole mini-batch of 64 sequences: the trainer's default
micro_batch_size = 0). On each stale call (lag >= 1) it then computes the loss once on the whole mini-batch
and once in P equal parts of consecutive rows (P micro-batches, or P ranks: the same per-call statistic),
each part with the whole mini-batch's normalizer, and prints per P: the share of valid tokens whose M2PO mask
differs, adaptive VESPO's lambda per part against the whole batch's, and the relative L2 difference of the
per-token gradient dL/dlogp (the parameter gradient is a linear map of it) and the cosine between them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from vespo.losses import LossInputs, get_loss, prepare_inputs
from vespo.losses.registry import LossSpec, register

CALLS: dict[str, list[dict[str, torch.Tensor]]] = {}


def recording(name: str):
    base = get_loss(name)

    def fn(x: LossInputs, cfg, normalizer=None):
        CALLS.setdefault(name, []).append({"logp": x.logp.detach().clone(), "old_logp": x.old_logp.clone(),
                                           "advantages": x.adv[:, 0].clone(), "mask": x.mask.clone()})
        return base.fn(x, cfg, normalizer)

    return LossSpec(f"{name}_recorded", fn, base.config_cls, per_row=base.per_row)


def record(base: Path, name: str, n: int, updates: int, seed: int, out: Path) -> list[dict[str, torch.Tensor]]:
    from vespo.config import load_config
    from vespo.trainer import train

    start = len(CALLS.get(name, []))
    cfg = load_config(base, [f"staleness.n={n}", f"run.updates={updates}", f"run.seed={seed}", "run.eval_every_updates=0",
                             f"loss.name={name}_recorded", "task.eval_size=64", "run.progress=false", "run.threads=1",
                             f"run.out_dir={out / f'{name}_seed{seed}'}"])
    train(cfg)
    return [c for j, c in enumerate(CALLS[name][start:]) if j % n != 0]  # lag 0 (W = 1) left out


def grad(name: str, batch: dict[str, torch.Tensor], normalizer: float):
    logp = batch["logp"].double().clone().requires_grad_(True)
    spec = get_loss(name)
    x = prepare_inputs(logp, batch["old_logp"].double(), batch["advantages"].double(), batch["mask"])
    out = spec.fn(x, spec.config_cls(), normalizer)
    (g,) = torch.autograd.grad(out.loss, logp)
    return g, out


def compare(name: str, batch: dict[str, torch.Tensor], parts: int) -> dict[str, float]:
    """Whole mini-batch vs ``parts`` calls on consecutive rows, with the whole batch's token normalizer."""
    tokens = float(batch["mask"].sum())
    whole, out = grad(name, batch, tokens)
    pieces = [grad(name, {k: v[rows] for k, v in batch.items()}, tokens)
              for rows in torch.tensor_split(torch.arange(len(batch["mask"])), parts)]
    split = torch.cat([g for g, _ in pieces])
    res = {"rel_l2": float((split - whole).norm() / whole.norm().clamp(min=1e-30)),
           "cosine": float(torch.nn.functional.cosine_similarity(split.flatten(), whole.flatten(), dim=0))}
    if name == "m2po":
        from vespo.losses.m2po import second_moment_mask

        m2 = torch.where(batch["mask"], batch["logp"].double() - batch["old_logp"].double(), 0.0).square()
        keep = second_moment_mask(m2, batch["mask"], get_loss("m2po").config_cls().m2_threshold)
        keep_split = torch.cat([second_moment_mask(m2[r], batch["mask"][r], 0.04)
                                for r in torch.tensor_split(torch.arange(len(m2)), parts)])
        res["mask_differs"] = float((keep != keep_split)[batch["mask"]].double().mean())
        res["masked_whole"] = float((~keep)[batch["mask"]].double().mean())
    else:
        lam = [out.metrics["vespo/lambda_pos"].item(), out.metrics["vespo/lambda_neg"].item()]
        part_lams = [[p.metrics["vespo/lambda_pos"].item(), p.metrics["vespo/lambda_neg"].item()] for _, p in pieces]
        res["lambda_abs_diff"] = max(abs(pl[i] - lam[i]) for pl in part_lams for i in range(2))
    return res


def summary(values: list[float]) -> str:
    t = torch.tensor(values, dtype=torch.float64)
    return (f"min {t.min().item():.4g}, q10 {t.quantile(0.1).item():.4g}, median {t.median().item():.4g}, "
            f"q90 {t.quantile(0.9).item():.4g}, max {t.max().item():.4g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=Path("configs/lab/bases/reverse16.yaml"))
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--updates", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", type=Path, default=Path("runs/batch_statistics"))
    args = parser.parse_args()
    for name in ("m2po", "vespo_adaptive"):
        register(recording(name))
        calls = [c for seed in args.seeds for c in record(args.base, name, args.n, args.updates, seed, args.out)]
        print(f"{name}: {len(calls)} stale mini-batches of {len(calls[0]['mask'])} sequences (N = {args.n})")
        for parts in args.parts:
            rows = [compare(name, c, parts) for c in calls]
            line = "; ".join(f"{key} {summary([r[key] for r in rows])}" for key in rows[0])
            print(f"  {parts} parts: {line}")


if __name__ == "__main__":
    main()
