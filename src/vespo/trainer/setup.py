"""Build a run's parts from its config: policy, tokenizer, rollout engine, data, reward, learner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vespo.config import Config, ConfigError
from vespo.types import Problem


@dataclass
class Parts:
    cfg: Config
    policy: torch.nn.Module  # the trainer's weights (float32 by default)
    tokenizer: Any
    engine: Any  # RolloutEngine with its own copy of the weights
    task: Any  # the built-in task, or None for a dataset
    stream: Any  # PromptStream over the training problems
    eval_problems: list[Problem]
    reward_fn: Any  # (completions, ground_truths) -> list[float]
    sampling: Any  # SamplingParams
    learner: Any
    producer: Any
    warmstart: dict[str, float]

    def close(self) -> None:
        closer = getattr(self.reward_fn, "close", None)
        if closer:
            closer()


def build_policy(cfg: Config):
    """(model, tokenizer): a local HF model directory, or a tiny model over the built-in tokenizer."""
    from vespo.models import build_char_tokenizer, load_policy, tiny_model

    m = cfg.model
    if m.path:
        return load_policy(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation)
    tok = build_char_tokenizer()
    torch.manual_seed(cfg.run.seed)
    model = tiny_model(arch=m.arch, size=m.size, tokenizer=tok, seed=cfg.run.seed)
    if m.attn_implementation:
        model.set_attn_implementation(m.attn_implementation)
    return model.to(getattr(torch, m.dtype)), tok


def build_data(cfg: Config):
    """(task or None, training problems, held-out problems)."""
    from vespo.data import load_problems
    from vespo.tasks import get_task

    t = cfg.task
    if t.dataset:
        problems = load_problems(t.dataset)
        n_eval = min(t.eval_size, len(problems) // 10)
        return None, problems[n_eval:], problems[:n_eval]
    try:
        task = get_task(t.name, **t.options)
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None
    train = task.generate(t.train_size, seed=cfg.run.seed)
    held_out = task.generate(t.eval_size, seed=cfg.run.seed + 1_000_003)
    return task, train, held_out


def build_reward(cfg: Config, task):
    """A batch reward function; failures come back as NaN and are reported, never turned into 0/1."""
    from vespo.rewards import RewardScorer, load_reward_fn

    if cfg.task.reward:
        scorer = RewardScorer(load_reward_fn(cfg.task.reward), timeout_s=10.0, num_workers=2)
    elif task is not None:
        scorer = RewardScorer(task.reward, num_workers=0)  # exact and cheap: in process
    else:
        from vespo.rewards import math_verify_reward

        scorer = RewardScorer(math_verify_reward, timeout_s=10.0, num_workers=2)

    def reward_fn(completions: list[str], truths: list[Any]) -> list[float]:
        return scorer.score(completions, truths).rewards

    reward_fn.close = scorer.close  # type: ignore[attr-defined]
    return reward_fn


def build(cfg: Config, log=print) -> Parts:
    from vespo.data import PromptStream
    from vespo.rollout import HFEngine, SamplingParams
    from vespo.trainer.learner import Learner
    from vespo.trainer.producer import RolloutProducer
    from vespo.trainer.warmstart import warm_start

    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    policy, tok = build_policy(cfg)
    task, train, held_out = build_data(cfg)
    ws_stats: dict[str, float] = {}
    if cfg.warmstart.enabled and task is not None and cfg.warmstart.steps > 0:
        ws_stats = warm_start(policy, tok, task, cfg, log=log)
    max_new = cfg.rollout.max_new_tokens or (task.max_answer_chars + 2 if task is not None else 0)
    if max_new <= 0:
        raise ConfigError("rollout.max_new_tokens must be set (> 0) when training on a dataset")
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=max_new)
    if r.engine == "vllm":
        from vespo.rollout import VLLMEngine

        engine = VLLMEngine(policy, tok, dtype=r.engine_dtype)
    else:
        from vespo.models import is_moe

        engine = HFEngine(policy, tok, dtype=r.engine_dtype,
                          record_routing=r.router_replay == "r3" and is_moe(policy))
    stream = PromptStream(train, seed=cfg.run.seed)
    reward_fn = build_reward(cfg, task)
    total_updates = cfg.run.steps * cfg.staleness.n
    learner = Learner(policy, cfg.loss.name, cfg.loss.options, cfg.optim, total_updates,
                      temperature=r.temperature, max_nonfinite=cfg.run.max_nonfinite_steps, compile=cfg.run.compile)
    producer = RolloutProducer(engine, tok, stream, reward_fn, sampling, r.group_size, cfg.advantage)
    return Parts(cfg, policy, tok, engine, task, stream, held_out, reward_fn, sampling, learner, producer, ws_stats)
