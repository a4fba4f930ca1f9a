"""The train-inference mismatch on the real model, measured: vLLM generating in bfloat16 against the learner's
recompute of the same tokens with the same weights, the learner in float32 and in bf16-mixed (model.autocast).

    PYTHONPATH=src .venv-vllm/bin/python bench/mismatch.py                 # ~6 min on 2 loaded cores; tables + JSON
    PYTHONPATH=src .venv-vllm/bin/python bench/mismatch.py --prompts 4 --group 4   # a quick look

Runs in the vLLM environment (scripts/setup_vllm_env.sh). The setting is the mismatch sweep's
(configs/lab/real_mismatch.yaml): SmolLM2-135M-Instruct on rg:chain_sum prompts with the chat template,
temperature 1, up to 48 new tokens, the weights before any training. One batch of --prompts prompts x --group
samples from vLLM in bfloat16 (its processed log-probs, log pi_engine); then the learner's log-probs of the same
tokens (log pi_learner, the path the learner's forwards take: shared prompts, float32 logits) once with float32
forwards and once under torch.autocast(bfloat16). Per learner precision:

- the token log-ratio log r = log pi_learner - log pi_engine (the log of the ratio every correction acts on:
  VESPO's and GRPO's W at N = 1 with mu = the engine's log-probs, TIS's and IcePop's pi / pi_rollout): its
  quantiles, mean, mean |log r|, and the share of tokens that TIS at C = 2 caps (r > 2) and that IcePop's band
  [0.5, 5] drops;
- the sequence log-ratio log W = sum of a response's log r: its quantiles, mean |log W|, and the mean and range of
  W itself.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from vespo.config import load_config  # noqa: E402
from vespo.data.stream import PromptStream  # noqa: E402
from vespo.models import response_logprobs  # noqa: E402
from vespo.trainer.producer import PromptSampler  # noqa: E402
from vespo.trainer.run import build_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUANTILES = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)
LEARNERS = {"float32": False, "bf16-mixed": True}  # learner precision -> model.autocast


def learner_logprobs(policy, rollout, temperature: float, autocast: bool):
    """log pi_learner [B, T] of the engine's tokens, as the learner computes it (shared prompts)."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with torch.no_grad(), ctx:
        logp, _ = response_logprobs(policy, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                    rollout.response_mask, temperature=temperature, with_entropy=False,
                                    share_prompts=True)
    return logp.float()


def distribution(log_r_bt: torch.Tensor, mask: torch.Tensor) -> dict:
    """Token and sequence statistics of log r [B, T] (masked)."""
    log_r = log_r_bt[mask > 0].double()
    log_w = (log_r_bt.double() * mask).sum(1)
    q = torch.tensor(QUANTILES, dtype=torch.float64)
    r = log_r.exp()
    return {
        "tokens": int(log_r.numel()), "sequences": int(log_w.numel()),
        "token_quantiles": dict(zip(map(str, QUANTILES), log_r.quantile(q).tolist())),
        "token_mean": float(log_r.mean()), "token_abs_mean": float(log_r.abs().mean()),
        "token_sd": float(log_r.std()), "token_abs_max": float(log_r.abs().max()),
        "tis2_capped_frac": float((r > 2.0).double().mean()),
        "icepop_dropped_frac": float(((r < 0.5) | (r > 5.0)).double().mean()),
        "seq_quantiles": dict(zip(map(str, QUANTILES), log_w.quantile(q).tolist())),
        "seq_mean": float(log_w.mean()), "seq_abs_mean": float(log_w.abs().mean()), "seq_sd": float(log_w.std()),
        "W_mean": float(log_w.exp().mean()), "W_min": float(log_w.exp().min()), "W_max": float(log_w.exp().max()),
    }


def table(results: dict, key: str, label: str) -> None:
    print(f"\n{label}: quantiles of the log-ratio (learner - engine)")
    print("| learner | " + " | ".join(f"q{q}" for q in QUANTILES) + " |")
    print("|---|" + "---|" * len(QUANTILES))
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{v:+.4f}" for v in r[key].values()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the learner")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    overrides = [f"run.threads={args.threads}", "model.autocast=false", "task.train_size=256", "task.eval_size=0"]
    cfg = load_config(str(ROOT / "configs" / "smollm2_chain_sum.yaml"), overrides)
    run = build_run(cfg, log=lambda *_: None)
    policy = run.policy.eval()
    sampler = PromptSampler(run.tokenizer, PromptStream(run.train_problems, seed=0), args.group)
    prompts = sampler.sample(args.prompts, first_group_id=0).prompt_ids

    from vespo.rollout import VLLMEngine

    engine = VLLMEngine(policy, run.tokenizer, dtype="bfloat16")
    rollout = engine.generate(prompts, run.sampling, seed=0)
    del engine
    results = {}
    for name, autocast in LEARNERS.items():
        learner = learner_logprobs(policy, rollout, run.sampling.temperature, autocast)
        results[name] = distribution(learner - rollout.logprobs.float(), rollout.response_mask.float())
        print(name, json.dumps(results[name]), flush=True)
    table(results, "token_quantiles", "token log r")
    table(results, "seq_quantiles", "sequence log W")
    print("\n| learner | mean log r | mean abs log r | SD log r | max abs log r | TIS C=2 capped | IcePop [0.5,5] "
          "dropped | mean abs log W | SD log W | W min | W max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['token_mean']:+.2e} | {r['token_abs_mean']:.2e} | {r['token_sd']:.2e} | "
              f"{r['token_abs_max']:.2f} | {r['tis2_capped_frac']:.2e} | {r['icepop_dropped_frac']:.2e} | "
              f"{r['seq_abs_mean']:.3f} | {r['seq_sd']:.3f} | {r['W_min']:.3f} | {r['W_max']:.3f} |")
    out = {"load_avg_start": load0, "load_avg_end": os.getloadavg()[0], "seconds": time.perf_counter() - t_start,
           "rows": args.prompts * args.group, "max_new_tokens": run.sampling.max_new_tokens, "learners": results}
    print(f"\n{out['rows']} sequences; load average {load0:.1f} at the start, {out['load_avg_end']:.1f} at the end; "
          f"{out['seconds']:.0f} s")
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
