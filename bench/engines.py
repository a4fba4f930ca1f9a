"""The rollout with each engine on the real model: HF and vLLM, float32 and bfloat16; and the log-ratio between vLLM's
bfloat16 log-probs and the float32 learner's.

    PYTHONPATH=src .venv-vllm/bin/python bench/engines.py            # ~10 min on 2 loaded cores; a table + JSON
    PYTHONPATH=src .venv-vllm/bin/python bench/engines.py --engines vllm-bfloat16 --rows 16

Runs in the vLLM environment (scripts/setup_vllm_env.sh), where vespo's HF engine runs too. The model is
SmolLM2-135M-Instruct (configs/smollm2_chain_sum.yaml: rg:chain_sum prompts with the chat template, temperature 1,
up to 48 new tokens); one batch of --prompts prompts x --group samples. Per engine: its load time, one warm-up
batch, then the timed batch (completion tokens / wall seconds); for vLLM also the time of a weight push of the
whole model (median of 3). Against the float32 learner (vespo's recompute of the same tokens, the policy's own
float32 weights), per engine: the token log-ratio log r = log mu_engine - log pi_learner (mean |log r|, p99
|log r|) and the sequence log-ratio log W = sum of a response's log r (mean and max |log W|). The load average at
the start and end is printed beside the numbers: on a shared machine tokens/s moves with it.
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
ENGINES = ("hf-float32", "hf-bfloat16", "vllm-float32", "vllm-bfloat16")


def make(kind: str, policy, tokenizer):
    backend, dtype = kind.split("-")
    if backend == "hf":
        from vespo.rollout import HFEngine

        return HFEngine(policy, tokenizer, dtype=dtype)
    from vespo.rollout import VLLMEngine

    return VLLMEngine(policy, tokenizer, dtype=dtype)


def log_ratios(policy, rollout) -> dict[str, float]:
    """Token and sequence log-ratios of the engine's log-probs against the float32 learner's."""
    with torch.no_grad():
        learner, _ = response_logprobs(policy, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                       rollout.response_mask, with_entropy=False)
    mask = rollout.response_mask > 0
    log_r = (rollout.logprobs - learner)[mask].double()
    log_w = ((rollout.logprobs - learner) * rollout.response_mask).double().sum(1)
    return {"token_abs_mean": float(log_r.abs().mean()), "token_abs_p99": float(log_r.abs().quantile(0.99)),
            "seq_abs_mean": float(log_w.abs().mean()), "seq_abs_max": float(log_w.abs().max()),
            "tokens": int(mask.sum()), "sequences": int(mask.shape[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the HF engine and the learner")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    cfg = load_config(str(ROOT / "configs" / "smollm2_chain_sum.yaml"),
                      [f"run.threads={args.threads}", "model.autocast=false", "task.train_size=256", "task.eval_size=0"])
    run = build_run(cfg, log=lambda *_: None)
    policy = run.policy.eval()
    sampler = PromptSampler(run.tokenizer, PromptStream(run.train_problems, seed=0), args.group)
    prompts = sampler.sample(args.prompts, first_group_id=0).prompt_ids
    warm = sampler.sample(1, first_group_id=args.prompts).prompt_ids
    results = {}
    for kind in args.engines.split(","):
        t0 = time.perf_counter()
        engine = make(kind, policy, run.tokenizer)
        load_s = time.perf_counter() - t0
        engine.generate(warm, run.sampling, seed=1)
        t0 = time.perf_counter()
        rollout = engine.generate(prompts, run.sampling, seed=0)
        gen_s = time.perf_counter() - t0
        row = {"load_s": load_s, "gen_s": gen_s, "tokens_per_s": float(rollout.response_mask.sum()) / gen_s,
               **log_ratios(policy, rollout)}
        if kind.startswith("vllm"):
            state = {k: v.detach() for k, v in policy.state_dict().items()}
            pushes = []
            for version in (1, 2, 3):
                t0 = time.perf_counter()
                engine.load_weights(state, version)
                pushes.append(time.perf_counter() - t0)
            row["push_s"] = sorted(pushes)[1]
        results[kind] = row
        print(kind, json.dumps(row), flush=True)
        del engine
    out = {"load_avg_start": load0, "load_avg_end": os.getloadavg()[0], "rows": args.prompts * args.group,
           "max_new_tokens": run.sampling.max_new_tokens, "threads": args.threads, "engines": results}
    print("| engine | tokens/s | load s | push s | mean abs log r | p99 abs log r | mean abs log W | max abs log W |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, r in results.items():
        push = f"{r['push_s']:.2f}" if "push_s" in r else "-"
        print(f"| {kind} | {r['tokens_per_s']:.0f} | {r['load_s']:.0f} | {push} | {r['token_abs_mean']:.2e} | "
              f"{r['token_abs_p99']:.2e} | {r['seq_abs_mean']:.2e} | {r['seq_abs_max']:.2e} |")
    print(f"load average {out['load_avg_start']:.1f} at the start, {out['load_avg_end']:.1f} at the end")
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
