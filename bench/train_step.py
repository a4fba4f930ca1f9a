"""Tokens/s of a full RL step (rollout, behavior recompute, N stale updates) in vespo, next to
TRL's GRPOTrainer running the same configuration in the same process.

    python bench/train_step.py [--steps 3] [--archs qwen3,qwen3_moe] [--size xs]

Same model (tiny Qwen3 / Qwen3-MoE from the same config and seed), same prompts (2-digit addition),
same batch (P prompts x G responses, N optimizer steps per rollout batch), same response cap,
temperature 1, no KL. Tokens are response tokens actually sampled. Prints one row per model and
the ratio vespo / TRL (> 1 means vespo is faster).
"""

from __future__ import annotations

import argparse
import time

import torch

P, G, N, MAX_NEW = 16, 8, 4, 8


def vespo_tokens_per_s(arch: str, size: str, steps: int) -> float:
    from vespo.config import load_config
    from vespo.trainer.setup import build
    from vespo.trainer.sync import train_step

    cfg = load_config(None, [f"model.arch={arch}", f"model.size={size}", "warmstart.enabled=false",
                             f"rollout.prompts_per_step={P}", f"rollout.group_size={G}", f"staleness.n={N}",
                             f"rollout.max_new_tokens={MAX_NEW}", "run.progress=false", "task.train_size=2000",
                             "task.eval_size=0"])
    parts = build(cfg)
    train_step(parts, 0)  # warm-up
    tokens, t0 = 0.0, time.perf_counter()
    for step in range(1, steps + 1):
        tokens += train_step(parts, step)["rollout/tokens"]
    return tokens / (time.perf_counter() - t0)


def trl_tokens_per_s(arch: str, size: str, steps: int) -> float:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from vespo.models import build_char_tokenizer, tiny_model
    from vespo.tasks import get_task

    task = get_task("addition", digits=2)
    problems = task.generate(P * (steps + 1) * 2, seed=0)
    data = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                       "ground_truth": [p.ground_truth for p in problems]})

    def reward(completions, ground_truth, **kw):
        return [task.reward(c, t) for c, t in zip(completions, ground_truth)]

    tok = build_char_tokenizer()
    model = tiny_model(arch, size, tokenizer=tok, seed=0)
    lengths: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            lengths.append(float(out["completion_mask"].sum()))
            return out

    args = GRPOConfig(output_dir="/tmp/vespo-bench-trl", per_device_train_batch_size=P * G // N,
                      num_generations=G, steps_per_generation=N, max_completion_length=MAX_NEW,
                      max_steps=N * (steps + 1), learning_rate=1e-4, loss_type="grpo", beta=0.0, temperature=1.0,
                      top_k=0, bf16=False, use_cpu=True, report_to="none", logging_steps=1000, save_strategy="no",
                      seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Timed(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    times: list[float] = []
    orig = trainer.training_step

    def timed_step(*a, **k):
        t = time.perf_counter()
        r = orig(*a, **k)
        times.append(time.perf_counter() - t)
        return r

    trainer.training_step = timed_step
    trainer.train()
    # drop the first generation batch (warm-up): its N training steps and its token count
    return sum(lengths[1:]) / sum(times[N:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--archs", default="qwen3,qwen3_moe")
    ap.add_argument("--size", default="xs")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"batch: {P} prompts x {G} responses, N = {N} updates per rollout, <= {MAX_NEW} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'model':<18} {'vespo tok/s':>12} {'TRL tok/s':>12} {'vespo / TRL':>12}")
    for arch in args.archs.split(","):
        ours = vespo_tokens_per_s(arch, args.size, args.steps)
        theirs = trl_tokens_per_s(arch, args.size, args.steps)
        print(f"{arch + '-' + args.size:<18} {ours:12.0f} {theirs:12.0f} {ours / theirs:12.2f}")


if __name__ == "__main__":
    main()
