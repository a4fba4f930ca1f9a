"""Time forward + backward of every policy loss next to a plain unfused policy gradient, in one run.

    OMP_NUM_THREADS=2 python bench/losses.py [--B 512] [--T 4096] [--repeats 3] [--device cpu]

The reference is the cheapest sensible loss: -(A * logp) masked token-mean. Each loss call
includes its input checks and all its diagnostics. Prints milliseconds (best of --repeats) and
the ratio to the reference; the goal is <= 2x.
"""

from __future__ import annotations

import argparse
import time

import torch

from vespo.losses import get_loss, loss_names


def make_inputs(B: int, T: int, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g) * 3  # [B, T]
    old_logp = logp - 0.05 * torch.randn(B, T, generator=g)  # [B, T]
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    adv = torch.randn(B, generator=g)  # [B]
    return {k: v.to(device) for k, v in dict(logp=logp, old_logp=old_logp, advantages=adv, mask=mask).items()}


def plain_reference(logp, old_logp, advantages, mask):
    m = mask.to(logp.dtype)
    return -(advantages[:, None] * logp * m).sum() / m.sum()


def time_it(step, repeats: int, device: str) -> float:
    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench_step(fn, inputs: dict):
    def step():
        logp = inputs["logp"].detach().requires_grad_(True)
        loss = fn(logp, inputs["old_logp"], inputs["advantages"], inputs["mask"])
        loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--B", type=int, default=512)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    inputs = make_inputs(args.B, args.T, args.device)
    print(f"B={args.B} T={args.T} float32 on {args.device}, {torch.get_num_threads()} threads")
    ref_ms = time_it(bench_step(plain_reference, inputs), args.repeats, args.device)
    print(f"{'plain -(A*logp) mean':<22} {ref_ms:9.1f} ms   1.00x")
    for name in loss_names():
        spec = get_loss(name)
        cfg = spec.config_cls()
        ms = time_it(bench_step(lambda *a, s=spec, c=cfg: s.fn(*a, c).loss, inputs), args.repeats, args.device)
        print(f"{name:<22} {ms:9.1f} ms {ms / ref_ms:6.2f}x")


if __name__ == "__main__":
    main()
