"""Warm starts: the weights every run of a seed starts RL from, made once and cached.

supervised (tiny models): RL needs a policy whose sampled reward is above zero. A few hundred steps of
next-token training on (prompt, correct completion + EOS) pairs get a character-level tiny model there.
Cached per (task, model, seed, warm-start settings), so a sweep warm-starts once.

on_policy (a real model): the seed's first on-policy updates (staleness.n = 1, VESPO, which on policy is
REINFORCE's update exactly) until the held-out sampled accuracy reaches warmstart.target_accuracy, run once
as a run of its own and cached with its held-out evaluation. Every condition of a comparison (loss,
staleness) that shares the seed then starts from the same weights, off floor and ceiling, and none takes
off by luck; the conditions' "before" evaluation is the start's own (the same weights and problems).

With LoRA (model.lora) the supervised start still trains the whole tiny model (shared with full-weight runs) and
the adapters go on top of it; the on-policy start trains adapters as its run does (cached apart) and its policy is
the merged one, on which the run puts fresh adapters.

    applies(cfg)                  whether a run warm-starts (the one rule; the sweep planner asks it too)
    warmstart_cache_path(cfg)     the file whose presence says the start is ready
    on_policy_config(cfg)         the start's own run config (trainer/loop.py runs it before the run)
    start_lr(cfg)                 its learning rate (warmstart.start_lr, else optim.lr)
    check_start(cfg)              refuses a start below warmstart.min_accuracy
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vespo.config import Config, from_dict, to_dict
from vespo.errors import StartError
from vespo.models import encode_prompt, response_logprobs
from vespo.rollout.base import SamplingParams


def warm_start(model: torch.nn.Module, tokenizer, task, cfg: Config, sampling: SamplingParams,
               log=print) -> dict[str, float]:
    """Train ``model`` in place on the task's reference completions (or load the cached result); ``sampling``
    is the rollout's, with which the accuracy target (if any) is measured."""
    ws = cfg.warmstart
    path = _cache_path(cfg)
    if path.is_file():
        model.load_state_dict(load_file(str(path)))
        log(f"warm start: loaded cached weights {path}")
        return json.loads(path.with_suffix(".json").read_text())
    problems = task.generate(ws.steps * ws.batch_size, seed=10_000 + cfg.run.seed)  # disjoint from RL's seed
    probe = AccuracyProbe(model, tokenizer, task, cfg, sampling) if ws.target_accuracy > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr)
    log(f"warm start: up to {ws.steps} supervised steps on the task's reference answers ({ws.batch_size} per step)")
    every = max(1, ws.steps // 10)
    model.train()
    loss, steps, accuracy = torch.zeros(()), 0, None  # accuracy is measured only with a target
    for step in range(ws.steps):
        chunk = problems[step * ws.batch_size : (step + 1) * ws.batch_size]
        batch = sft_batch(chunk, task, tokenizer)
        logp, _ = response_logprobs(model, *batch, with_entropy=False)
        loss = -(logp * batch[3]).sum() / batch[3].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps = step + 1
        if steps % every == 0 and steps < ws.steps:
            log(f"warm start: step {steps}/{ws.steps}, loss {float(loss.detach()):.3f}")
        if probe is not None and steps % ws.check_every == 0:
            accuracy = probe(steps)
            if accuracy >= ws.target_accuracy:
                break
    model.eval()
    stats = {"warmstart/final_loss": float(loss.detach()), "warmstart/steps": float(steps)}
    if accuracy is not None:
        stats["warmstart/sampled_accuracy"] = accuracy
    path.parent.mkdir(parents=True, exist_ok=True)
    # each process writes its own temporary files and renames them into place: two runs warm-starting the
    # same cache entry at once (test workers, sweeps on a shared disk) never read a half-written file
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp_stats = path.with_suffix(f".{os.getpid()}.json.tmp")
    tmp_stats.write_text(json.dumps(stats))
    tmp_stats.replace(path.with_suffix(".json"))
    tmp.replace(path)
    measured = "" if accuracy is None else f", sampled accuracy {accuracy:.3f}"
    log(f"warm start: {steps} supervised steps, final loss {stats['warmstart/final_loss']:.3f}{measured} -> {path}")
    return stats


class AccuracyProbe:
    """Sampled accuracy of the model being warm-started, on fixed held-out problems (the held-out
    evaluation of training, on its own problems)."""

    def __init__(self, model, tokenizer, task, cfg: Config, sampling: SamplingParams, n: int = 128):
        from vespo.rewards import RewardScorer
        from vespo.rollout import HFEngine, TextGenerator

        self.engine = HFEngine(model, tokenizer)
        self.model = model
        self.generate = TextGenerator(self.engine, tokenizer)
        self.problems = task.generate(n, seed=20_000 + cfg.run.seed)
        self.scorer = RewardScorer(task.reward, num_workers=0)
        self.sampling = sampling
        self.seed = cfg.run.seed

    @torch.no_grad()
    def __call__(self, version: int) -> float:
        from vespo.evaluation import heldout_rewards

        self.engine.load_weights(self.model.state_dict(), version)
        out = heldout_rewards(self.generate, self.problems, self.scorer, self.sampling, self.seed, kinds=("sampled",))
        return out["reward_sampled"]


def applies(cfg: Config) -> bool:
    """Whether this run warm-starts: supervised on a built-in task, on-policy on a task or a dataset."""
    w = cfg.warmstart
    if not w.enabled or w.steps == 0:
        return False
    return w.kind == "on_policy" or not cfg.task.dataset


def warmstart_cache_path(cfg: Config) -> Path:
    """The file whose presence says the warm start of this config is ready (shared by runs that differ only
    after it): the supervised weights, or the on-policy start's record ``start.json``."""
    return on_policy_dir(cfg) / START_RECORD if cfg.warmstart.kind == "on_policy" else _cache_path(cfg)


# ---------------------------------------------------------------- the on-policy start

START_RECORD = "start.json"  # written last: {"updates", "eval", "target_reached", "seconds"}
# what the start does not depend on: the conditions it is shared by differ in these (and in run.* but the seed)
_NOT_IN_START = ("loss", "staleness.n", "async")


def on_policy_config(cfg: Config) -> Config:
    """The start's run: this run at staleness.n = 1 on its own mini-batch with VESPO (on policy, every loss's update
    is REINFORCE's), warmstart.steps updates, a held-out check every warmstart.check_every updates when a target is
    set, sync mode, written into the cache (no checkpoints: a start killed part-way is run again). mu is the
    trainer's recompute whatever the run's staleness.behavior (``_start_behavior``): on policy W = 1 exactly, so the
    conditions of a seed that differ in mu (an engine's log-probs or the recompute) share one start."""
    data = to_dict(cfg)
    w = cfg.warmstart
    data["loss"] = {"name": "vespo"}
    data["optim"] = {**data["optim"], "lr": start_lr(cfg)}
    data["staleness"] = {**data["staleness"], "n": 1, "minibatch_prompts": cfg.prompts_per_minibatch,
                         "behavior": _start_behavior(cfg)}
    data["rollout"]["prompts_per_step"] = cfg.prompts_per_minibatch
    data["warmstart"] = {"enabled": False}
    data.pop("async", None)
    data["run"] = {**data["run"], "mode": "sync", "updates": w.steps, "steps": w.steps,
                   "out_dir": str(on_policy_dir(cfg) / "run"), "eval_every": 0,
                   "eval_every_updates": w.check_every if w.target_accuracy > 0 else 0,
                   "checkpoint_every": 0, "save_policy_every": 0}
    return from_dict(data)


def start_lr(cfg: Config) -> float:
    """The learning rate of the on-policy start's updates: warmstart.start_lr where set, else the run's optim.lr."""
    return cfg.optim.lr if cfg.warmstart.start_lr is None else cfg.warmstart.start_lr


def _start_behavior(cfg: Config) -> str:
    """mu of the start's updates: the recompute where the run asks for the engine's log-probs (rollout), else the
    run's own setting (auto is the recompute in the start's sync mode; kept as written, so the keys of the starts
    made before stay the same)."""
    return "recompute" if cfg.staleness.behavior == "rollout" else cfg.staleness.behavior


def on_policy_dir(cfg: Config) -> Path:
    """The cache entry of this config's on-policy start: everything the start's updates depend on, hashed."""
    data = to_dict(cfg)
    for dotted in _NOT_IN_START:
        section, _, name = dotted.partition(".")
        if name:
            data[section].pop(name, None)
        else:
            data.pop(section, None)
    data["rollout"].pop("prompts_per_step", None)
    data["staleness"]["behavior"] = _start_behavior(cfg)
    run = data.pop("run")
    data["run"] = {k: run[k] for k in ("seed", "threads", "eval_every_size") if k in run}
    data["warmstart"].pop("cache_dir")
    data["warmstart"].pop("start_lr", None)  # what acts is the start's lr, wherever it is set (the keys made before)
    data["warmstart"].pop("min_accuracy", None)  # judges the start, does not make it
    data["optim"]["lr"] = start_lr(cfg)
    if not cfg.model.lora.rank:  # LoRA off: the key of the starts made before model.lora existed
        data["model"].pop("lora")
    data["version"] = 1
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]
    name = f"{cfg.task.name if not cfg.task.dataset else Path(cfg.task.dataset).stem}-seed{cfg.run.seed}-{digest}"
    return Path(cfg.warmstart.cache_dir).expanduser() / "on_policy" / name.replace(":", "_").replace("/", "_")


def read_start(cfg: Config) -> dict:
    """The on-policy start's record (updates, held-out evaluation of its weights, whether it met its target)."""
    return json.loads(warmstart_cache_path(cfg).read_text())


def check_start(cfg: Config) -> None:
    """Refuse to train from an on-policy start below warmstart.min_accuracy (StartError, naming seed and start)."""
    floor = cfg.warmstart.min_accuracy
    if floor == 0:
        return
    record = read_start(cfg)
    accuracy = float(record["eval"].get("reward_sampled", float("nan")))
    if not accuracy >= floor:
        raise StartError(
            f"the on-policy start of seed {cfg.run.seed} ended at held-out sampled accuracy {accuracy:.3f} after "
            f"{record['updates']} updates, below warmstart.min_accuracy={floor:g}: no run of this seed trains from it "
            f"(its conditions would have nothing to fall from). Replace the seed (in a sweep file: exclude it, "
            f"`exclude: [{{seed: [\"{cfg.run.seed}\"]}}]`, and add the next unused seed), or lower "
            f"warmstart.min_accuracy. The start: {on_policy_dir(cfg)}")


def start_policy_dir(cfg: Config) -> Path:
    """The on-policy start's weights: a Hugging Face directory (its run's policy/)."""
    return on_policy_dir(cfg) / "run" / "policy"


def start_stats(record: dict) -> dict[str, float]:
    """The summary's warm-start figures of an on-policy start."""
    return {"warmstart/updates": float(record["updates"]),
            "warmstart/sampled_accuracy": float(record["eval"].get("reward_sampled", float("nan"))),
            "warmstart/target_reached": float(record["target_reached"])}


def sft_batch(problems, task, tokenizer):
    """(prompt_ids [B,P] left-padded, prompt_mask, response_ids [B,T] right-padded, response_mask)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    answers = [encode_prompt(tokenizer, task.reference_completion(p)) + [eos] for p in problems]
    P, T = max(map(len, prompts)), max(map(len, answers))
    prompt_ids = torch.tensor([[pad] * (P - len(x)) + x for x in prompts])  # [B, P]
    prompt_mask = torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in prompts])  # [B, P]
    response_ids = torch.tensor([x + [pad] * (T - len(x)) for x in answers])  # [B, T]
    response_mask = torch.tensor([[1.0] * len(x) + [0.0] * (T - len(x)) for x in answers])  # [B, T]
    return prompt_ids, prompt_mask, response_ids, response_mask


def _cache_path(cfg: Config) -> Path:
    key = {"task": to_dict(cfg.task), "model": to_dict(cfg.model), "warmstart": to_dict(cfg.warmstart),
           "seed": cfg.run.seed, "version": 1}
    if cfg.warmstart.target_accuracy > 0:  # the probe samples with the rollout settings
        key["sampling"] = [cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.max_new_tokens]
    key["warmstart"].pop("cache_dir")
    for name in ("start_lr", "min_accuracy"):  # refused with a supervised start
        key["warmstart"].pop(name, None)
    key["model"].pop("lora")  # the supervised start trains the whole model; LoRA's adapters go on top of it
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    name = f"{cfg.task.name}-{cfg.model.arch}-{cfg.model.size}-seed{cfg.run.seed}-{digest}.safetensors"
    return Path(cfg.warmstart.cache_dir).expanduser() / name
