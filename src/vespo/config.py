"""The run configuration: one dataclass per stage, every field documented and validated.

A config is read from YAML and then patched by command-line overrides written as dotted paths:

    vespo train --config configs/demo.yaml loss.name=gspo staleness.n=32 optim.lr=2e-4

Every field carries its help text and its allowed range in ``metadata``; :func:`validate` checks
them all and names the field in its error (``staleness.n must be >= 1, got 0``).

Staleness, exactly: one rollout batch of ``rollout.prompts_per_step`` prompts (each with
``rollout.group_size`` responses) is split into ``staleness.n`` mini-batches, one optimizer step
each. The policy version counts optimizer steps, so mini-batch j (0-based) is trained when the
policy is j versions past the weights that sampled it: its lag is j.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vespo.errors import UserError


def opt(default: Any, help: str, **rules: Any) -> Any:
    """A dataclass field with its help text and validation rules (ge, gt, le, lt, choices)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **rules})
    return field(default=default, metadata={"help": help, **rules})


@dataclass
class ModelConfig:
    path: str | None = opt(None, "the policy to start from: a local Hugging Face directory, a Hub id (org/name), a "
                           ".gguf file (dequantized; needs vespo[gguf]) or offline:NAME (`vespo model list`); None "
                           "builds a tiny model from `arch`/`size`")
    arch: str = opt("qwen3", "tiny-model architecture", choices=["qwen3", "llama", "qwen3_moe"])
    size: str = opt("xs", "tiny-model size preset", choices=["nano", "xs", "s", "m"])
    dtype: str = opt("float32", "trainer precision", choices=["float32", "bfloat16"])
    attn_implementation: str | None = opt(None, "attention kernel of the trainer (None: the model's default)")
    device: str = opt("auto", "device of the learner (policy, optimizer): auto (CUDA when present, else CPU), cpu, "
                      "cuda or cuda:N")
    autocast: bool = opt(False, "run the learner's forward passes under torch.autocast in bfloat16 (weights and "
                         "optimizer stay in model.dtype)")


@dataclass
class TaskConfig:
    name: str = opt("addition", "built-in task (see `vespo.tasks.task_names()`) or rg:NAME, any reasoning-gym "
                    "dataset (`vespo task list`); used when `dataset` is None")
    options: dict = opt({}, "keyword options of the task, e.g. {digits: 2}; for rg:NAME the dataset's own options "
                        "plus chat (render with the chat template, default true), partial_credit, instruction")
    dataset: str | None = opt(None, "verl-style parquet/jsonl file of training prompts (overrides `name`)")
    reward: str | None = opt(None, "reward function as 'module:function'; None uses the task's exact reward")
    train_size: int = opt(20000, "number of built-in task problems generated for the training stream", ge=1)
    eval_size: int = opt(256, "number of held-out problems for the greedy/sampled evaluation", ge=0)


@dataclass
class RolloutConfig:
    prompts_per_step: int = opt(32, "prompts per rollout batch (the paper's gbs)", ge=1)
    group_size: int = opt(8, "responses sampled per prompt (G)", ge=1)
    temperature: float = opt(1.0, "sampling temperature (also used for the trainer's log-probs)", gt=0.0)
    top_p: float = opt(1.0, "nucleus sampling mass; 1.0 is off", gt=0.0, le=1.0)
    top_k: int = opt(0, "top-k sampling; 0 is off", ge=0)
    max_new_tokens: int = opt(0, "response length cap; 0 sizes it from the task's longest answer", ge=0)
    engine_dtype: str = opt("float32", "precision of the rollout engine; bfloat16 gives a real train-inference mismatch",
                            choices=["float32", "bfloat16"])
    engine: str = opt("hf", "rollout engine backend", choices=["hf", "vllm"])
    device: str | None = opt(None, "device of the HF rollout engine: auto, cpu, cuda or cuda:N; None follows "
                             "model.device (vLLM always runs on CUDA)")
    router_replay: str = opt("none", "MoE router replay (docs/router_replay.md): r2 records the experts of the "
                             "trainer's recompute of mu and replays them in every training forward; r3 records "
                             "the rollout engine's (prompt included; HF engine only) and replays them in the "
                             "recompute and every training forward; a no-op on a dense model",
                             choices=["none", "r2", "r3"])


@dataclass
class StalenessConfig:
    n: int = opt(8, "mini-batches (optimizer steps) per rollout batch; mini-batch j has version lag j", ge=1)
    minibatch_prompts: int = opt(0, "prompts per mini-batch (the paper's mbs / G). When > 0 the rollout batch is "
                                 "derived: rollout.prompts_per_step = staleness.n x this, so N varies alone at a "
                                 "fixed mini-batch (the paper's protocol); 0 splits rollout.prompts_per_step instead",
                                 ge=0)
    behavior: str = opt("auto", "behavior policy mu: recompute = the trainer's log-probs of the weights that sampled "
                        "the batch (sync mode only), rollout = the engine's own log-probs (verl's bypass mode: the "
                        "rollout correction then acts on pi/pi_rollout), auto = recompute in sync mode and rollout "
                        "in async mode", choices=["auto", "recompute", "rollout"])
    shuffle: bool = opt(True, "sync mode: deal a rollout batch's groups to its mini-batches in random order (async "
                        "mode draws each mini-batch straight from the shuffled prompt stream)")


@dataclass
class AdvantageConfig:
    estimator: str = opt("grpo", "group baseline: grpo = (R - mean)/(std + eps), mean = R - mean, rloo = leave-one-out",
                         choices=["grpo", "mean", "rloo"])
    eps: float = opt(1e-6, "added to the group std", gt=0.0)
    skip_zero_variance: bool = opt(False, "drop groups whose rewards are all equal (their advantage is 0)")


@dataclass
class LossConfig:
    name: str = opt("vespo", "policy loss (see `vespo.losses.loss_names()`)")
    options: dict = opt({}, "options of that loss's own config, e.g. {k_pos: 2.0, length_norm: sqrt}; "
                        "rollout_correction: {mode: ...} acts on pi_old/pi_rollout with mu recomputed and, with "
                        "mu = the engine's log-probs (behavior rollout), as its rejection part on pi/pi_rollout "
                        "(tis_* refused there but for reinforce with is_level=none); opsm_delta masks A < 0 "
                        "sequences whose mean log(mu/pi) > delta (docs/losses.md)")


@dataclass
class OptimConfig:
    lr: float = opt(1e-4, "AdamW learning rate", gt=0.0)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0.0)
    beta1: float = opt(0.9, "AdamW beta1", ge=0.0, lt=1.0)
    beta2: float = opt(0.999, "AdamW beta2", ge=0.0, lt=1.0)
    grad_clip: float = opt(1.0, "max global gradient norm; 0 disables clipping", ge=0.0)
    schedule: str = opt("constant", "learning-rate schedule over optimizer steps", choices=["constant", "linear", "cosine"])
    warmup_steps: int = opt(0, "linear warm-up optimizer steps", ge=0)
    micro_batch_size: int = opt(0, "sequences per forward/backward; 0 means the whole mini-batch", ge=0)
    ess_scaled_lr: bool = opt(False, "VCPO's step size: scale each optimizer step's lr by sqrt(ESS / B) of the "
                              "mini-batch's sequence weights W (optim.ess_against), ESS = (sum W)^2 / sum W^2 (<= 1; "
                              "1 on policy), for that step only; works with every loss; logged as optim/ess_lr_scale")
    ess_against: str = opt("mu", "W of optim.ess_scaled_lr: mu = pi/mu, the loss's own ratio (exactly 1 at "
                           "staleness.n=1 with mu recomputed); engine = pi/pi_rollout against the engine's log-probs, "
                           "VCPO's (the same as mu when staleness.behavior=rollout)", choices=["mu", "engine"])


@dataclass
class WarmStartConfig:
    enabled: bool = opt(True, "supervised warm start on the task's correct answers before RL (tiny models)")
    steps: int = opt(200, "supervised steps (the most, when target_accuracy is set)", ge=0)
    target_accuracy: float = opt(0.0, "stop once the sampled accuracy (temperature as in rollout) on held-out "
                                 "problems reaches this; 0 runs all `steps`. Gives every seed a similar start",
                                 ge=0.0, le=1.0)
    check_every: int = opt(10, "supervised steps between accuracy checks when target_accuracy is set", ge=1)
    lr: float = opt(1e-3, "supervised AdamW learning rate", gt=0.0)
    batch_size: int = opt(128, "supervised batch size", ge=1)
    cache_dir: str = opt("~/.cache/vespo/warmstart", "where warm-started weights are cached per task, model and seed")


@dataclass
class AsyncConfig:
    workers: int = opt(1, "rollout worker processes (Ray actors)", ge=1)
    sync_every: int = opt(4, "learner updates between parameter pushes to the rollout workers (K)", ge=1)
    max_staleness: int = opt(8, "rollout may run at most this many policy versions ahead of the learner: a row "
                             "is trained at most this many versions after its oldest token was sampled", ge=0)
    chunk_tokens: int = opt(4, "tokens decoded between weight-update checks (partial rollouts)", ge=1)
    ray_address: str | None = opt(None, "existing Ray cluster address; None starts a local Ray")
    max_restarts: int = opt(3, "times a crashed rollout worker is restarted before the run stops", ge=0)
    stall_timeout_s: float = opt(300.0, "the learner stops with an error if no rollout arrives for this long "
                                 "(a dead Ray node, a wedged worker)", gt=0.0)
    learner: str = opt("local", "where the learner runs: local = in the driver process, actor = a Ray actor with "
                       "its own resources (e.g. the GPU node of a cluster)", choices=["local", "actor"])
    learner_workers: int = opt(1, "learner actors (async.learner=actor): P > 1 shards the learner over P Ray actors "
                               "that form one torch.distributed group (FSDP2)", ge=1)
    learner_num_cpus: float = opt(1.0, "CPUs reserved for each learner actor (async.learner=actor)", ge=0.0)
    learner_num_gpus: float = opt(0.0, "GPUs reserved for each learner actor (async.learner=actor)", ge=0.0)


@dataclass
class RunConfig:
    steps: int = opt(40, "rollout steps (each is staleness.n optimizer steps)", ge=1)
    updates: int = opt(0, "run length in optimizer steps; when > 0, run.steps is derived as updates / staleness.n "
                       "(which must divide it), so runs at different N take equal optimizer steps", ge=0)
    seed: int = opt(0, "seed of data order, sampling and initialization", ge=0)
    out_dir: str = opt("runs/demo", "run directory: metrics.jsonl, TensorBoard events, checkpoints, summary")
    mode: str = opt("sync", "training mode", choices=["sync", "async"])
    checkpoint_every: int = opt(10, "rollout steps between checkpoints; 0 writes one only at the end", ge=0)
    eval_every: int = opt(0, "rollout steps between evaluations on held-out problems; 0 only before and after", ge=0)
    eval_every_updates: int = opt(0, "optimizer steps between evaluations on held-out problems (a multiple of "
                                  "staleness.n), so runs at every N are evaluated after the same updates; 0 never",
                                  ge=0)
    eval_every_size: int = opt(0, "held-out problems in each evaluation during the run (run.eval_every, "
                               "run.eval_every_updates): the first ones of the held-out set, the same each time; "
                               "0 all of them", ge=0)
    log_samples_every: int = opt(10, "rollout steps between sample logs (RUN_DIR/samples.jsonl and TensorBoard "
                                 "text); 0 never", ge=0)
    samples_per_log: int = opt(4, "rows written per sample log: prompt, completion, reward, advantage, lag, log W, "
                               "the loss's weight", ge=1)
    save_policy_every: int = opt(0, "rollout steps between writes of RUN_DIR/policy (a Hugging Face directory); "
                                 "0 writes it at the end of the run only", ge=0)
    max_nonfinite_steps: int = opt(3, "consecutive skipped non-finite updates before the run stops", ge=1)
    loggers: list = opt(["jsonl", "tensorboard"], "metric sinks: jsonl, tensorboard, wandb")
    progress: bool = opt(True, "show a rich progress bar")
    threads: int = opt(0, "torch CPU threads; 0 keeps torch's default", ge=0)
    compile: bool = opt(False, "torch.compile the trainer's decoder layers (forward and backward of mu and the "
                        "updates); the first steps pay the compilation (tens of seconds on CPU, less with a warm "
                        "cache), later ones run faster; falls back to eager, with a warning, where it cannot compile")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"yaml": "async"})
    run: RunConfig = field(default_factory=RunConfig)

    # Values derived from the fields, in this one place; validation checks them and never rewrites a field.

    @property
    def prompts_per_step(self) -> int:
        """Prompts per rollout batch: staleness.n x staleness.minibatch_prompts when that is set (the paper's
        protocol: N varies at a fixed mini-batch), else rollout.prompts_per_step."""
        if self.staleness.minibatch_prompts:
            return self.staleness.n * self.staleness.minibatch_prompts
        return self.rollout.prompts_per_step

    @property
    def steps(self) -> int:
        """Rollout steps of the run: run.updates / staleness.n when run.updates is set, else run.steps."""
        return self.run.updates // self.staleness.n if self.run.updates else self.run.steps

    @property
    def responses_per_step(self) -> int:
        return self.prompts_per_step * self.rollout.group_size

    @property
    def prompts_per_minibatch(self) -> int:
        return self.prompts_per_step // self.staleness.n

    @property
    def behavior(self) -> str:
        """mu's source with auto resolved: recompute (sync mode) or rollout (async mode)."""
        if self.staleness.behavior != "auto":
            return self.staleness.behavior
        return "rollout" if self.run.mode == "async" else "recompute"

    @property
    def total_updates(self) -> int:
        """Optimizer steps of the whole run: ``steps`` rollout steps of staleness.n updates."""
        return self.steps * self.staleness.n


class ConfigError(UserError, ValueError):
    """A config value is missing, unknown or out of its allowed range."""


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (or the built-in defaults), apply ``a.b=value`` overrides, validate."""
    cfg = from_dict(load_yaml(path) if path is not None else {})
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def load_yaml(path: str | Path, what: str = "config", error: type[Exception] = ConfigError) -> dict:
    """The mapping a YAML file holds ({} when it is empty): the project's one YAML reader. A missing file,
    broken YAML or a top level that is not a mapping raise ``error`` in one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise error(f"{path}: not valid YAML ({getattr(e, 'problem', None) or e}"
                    f"{f' at line {mark.line + 1}' if mark else ''})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _yaml_name(f: dataclasses.Field) -> str:
    return f.metadata.get("yaml", f.name)


def from_dict(data: dict, cls: type = Config, prefix: str = "") -> Any:
    """Build a (nested) config dataclass from plain data, rejecting unknown keys by name."""
    fields = {_yaml_name(f): f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        where = prefix.rstrip(".") or "the config"
        raise ConfigError(f"unknown field(s) {sorted(unknown)} in {where}; valid: {sorted(fields)}")
    kwargs = {}
    for key, value in data.items():
        f = fields[key]
        if _is_section(cls, f):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key} must be a mapping, got {value!r}")
            kwargs[f.name] = from_dict(value, _field_type(cls, f), f"{prefix}{key}.")
        else:
            kwargs[f.name] = _coerce(value, _field_type(cls, f), f"{prefix}{key}")
    return cls(**kwargs)


def apply_override(cfg: Config, item: str) -> None:
    """Apply one ``section.field=value`` override; the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        fields = {_yaml_name(f): f for f in dataclasses.fields(node)}
        if part not in fields:
            where = ".".join(parts[:i]) or "the config"
            raise ConfigError(f"unknown field {dotted!r}: {where} has {sorted(fields)}")
        f = fields[part]
        if i == len(parts) - 1:
            if _is_section(type(node), f):
                raise ConfigError(f"{dotted} is a section; set one of its fields, e.g. {dotted}.<field>=...")
            value = yaml.safe_load(raw) if raw.strip() else None
            setattr(node, f.name, _coerce(value, _field_type(type(node), f), dotted))
        else:
            if not _is_section(type(node), f):
                # dict-valued options accept a.b.key=value
                if isinstance(getattr(node, f.name), dict) and i == len(parts) - 2:
                    getattr(node, f.name)[parts[-1]] = yaml.safe_load(raw)
                    return
                raise ConfigError(f"{'.'.join(parts[: i + 1])} is not a section")
            node = getattr(node, f.name)


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    return typing.get_type_hints(cls)[f.name]


def _is_section(cls: type, f: dataclasses.Field) -> bool:
    t = _field_type(cls, f)
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check (and gently convert int -> float) a value against a field's annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML reads "1e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool, dict, list) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{name} must be {tp.__name__}, got {value!r}")
    return value


# ---------------------------------------------------------------- validation


def validate(cfg: Config) -> Config:
    """Check every field's range and the cross-field rules; raise ConfigError naming the field."""
    _validate_section(cfg, "")
    r, s = cfg.rollout, cfg.staleness
    if cfg.run.updates and cfg.run.updates % s.n:
        raise ConfigError(f"staleness.n={s.n} must divide run.updates={cfg.run.updates} (a run is whole "
                          "rollout steps of N optimizer steps each)")
    if cfg.run.eval_every_updates % s.n:
        raise ConfigError(f"run.eval_every_updates={cfg.run.eval_every_updates} must be a multiple of staleness.n={s.n} "
                          "(evaluations fall between rollout steps)")
    if not s.minibatch_prompts and r.prompts_per_step % s.n:
        raise ConfigError(f"staleness.n={s.n} must divide rollout.prompts_per_step={r.prompts_per_step} "
                          "(each mini-batch holds whole groups)")
    if r.group_size < 2 and cfg.advantage.estimator in ("grpo", "rloo", "mean"):
        raise ConfigError(f"rollout.group_size must be >= 2 for a group baseline, got {r.group_size}")
    if cfg.optim.micro_batch_size:
        per_mb = cfg.prompts_per_minibatch * r.group_size
        if per_mb % cfg.optim.micro_batch_size:
            raise ConfigError(f"optim.micro_batch_size={cfg.optim.micro_batch_size} must divide the mini-batch "
                              f"of {per_mb} sequences")
    _validate_modes(cfg)
    bad = [x for x in cfg.run.loggers if x not in ("jsonl", "tensorboard", "wandb")]
    if bad:
        raise ConfigError(f"run.loggers has unknown sink(s) {bad}; choose from jsonl, tensorboard, wandb")
    _validate_loss(cfg.loss, bypass=cfg.behavior == "rollout")
    if cfg.optim.ess_against == "engine" and not cfg.optim.ess_scaled_lr:
        raise ConfigError("optim.ess_against=engine chooses the weights of optim.ess_scaled_lr, which is off; "
                          "set optim.ess_scaled_lr=true or leave optim.ess_against=mu")
    return cfg


def check_launch(cfg: Config, ranks: int) -> None:
    """What a torchrun job of ``ranks`` processes can run: sync mode (async mode shards its learner over Ray
    actors, async.learner_workers), and a batch that splits evenly over the ranks."""
    if cfg.run.mode == "async":
        raise ConfigError("--nproc shards a sync run's learner; in async mode shard it over Ray actors with "
                          "async.learner=actor async.learner_workers=P (docs/distributed.md)")
    check_world(cfg, ranks)


def check_world(cfg: Config, ranks: int) -> None:
    """The batch splits evenly over ``ranks`` learner processes (``vespo train --nproc``): each rank takes
    whole prompt groups of every mini-batch, in whole micro-batches."""
    if ranks <= 1:
        return
    per_mb = cfg.prompts_per_minibatch
    if per_mb % ranks:
        raise ConfigError(f"{ranks} processes must divide the {per_mb} prompts of a mini-batch "
                          f"(rollout.prompts_per_step={cfg.prompts_per_step} / staleness.n={cfg.staleness.n}): "
                          "each rank trains whole prompt groups of every mini-batch")
    local = per_mb // ranks * cfg.rollout.group_size
    if cfg.optim.micro_batch_size and local % cfg.optim.micro_batch_size:
        raise ConfigError(f"optim.micro_batch_size={cfg.optim.micro_batch_size} must divide the {local} sequences "
                          f"each of the {ranks} processes trains per mini-batch")
    if cfg.advantage.skip_zero_variance:
        raise ConfigError(f"advantage.skip_zero_variance drops rows, so {ranks} processes would train unequal "
                          "shares of a mini-batch; turn it off to shard the learner")


def _validate_modes(cfg: Config) -> None:
    """Options that mean the same in sync and async mode, or are rejected where they cannot apply."""
    if cfg.run.mode == "async" and cfg.staleness.behavior == "recompute":
        raise ConfigError("staleness.behavior=recompute cannot apply in async mode: a row's tokens may come from "
                          "several policy versions (partial rollouts) whose weights are gone by training time; "
                          "use staleness.behavior=rollout (or auto)")
    if cfg.rollout.router_replay == "r2" and cfg.run.mode == "async":
        raise ConfigError("rollout.router_replay=r2 replays the routing of the trainer's pass over the weights that "
                          "sampled the batch, which async mode does not have (rows span versions, mu is the "
                          "engine's); use rollout.router_replay=r3")
    if cfg.run.compile and cfg.rollout.router_replay != "none":
        raise ConfigError(f"run.compile=true cannot run with rollout.router_replay={cfg.rollout.router_replay}: "
                          "compiled layers ignore the replay hooks; set run.compile=false (replay is a no-op on "
                          "a dense model: there, set rollout.router_replay=none)")
    if cfg.run.mode == "sync" and cfg.async_.learner != "local":
        raise ConfigError("async.learner=actor applies to async mode (run.mode=async) only")
    if cfg.async_.learner_workers > 1:
        if cfg.async_.learner != "actor" or cfg.run.mode != "async":
            raise ConfigError("async.learner_workers > 1 shards the learner actor: it needs run.mode=async and "
                              "async.learner=actor (for a sharded sync learner use `vespo train --nproc P`)")
        check_world(cfg, cfg.async_.learner_workers)
    for name, value in (("model.device", cfg.model.device), ("rollout.device", cfg.rollout.device)):
        if value is not None and not _is_device(value):
            raise ConfigError(f"{name} must be auto, cpu, cuda or cuda:N, got {value!r}")


def _is_device(value: str) -> bool:
    head, _, index = value.partition(":")
    return value in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit())


def _validate_section(node: Any, prefix: str) -> None:
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        name = f"{prefix}{_yaml_name(f)}"
        if dataclasses.is_dataclass(value):
            _validate_section(value, name + ".")
            continue
        m = f.metadata
        if value is None:
            continue
        if "choices" in m and value not in m["choices"]:
            raise ConfigError(f"{name} must be one of {m['choices']}, got {value!r}")
        for rule, ok, text in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                               ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
            if rule in m and not ok(value, m[rule]):
                raise ConfigError(f"{name} must be {text} {m[rule]}, got {value!r}")


def _validate_loss(loss: LossConfig, bypass: bool) -> None:
    """The loss's own config builds; with mu = the engine's log-probs (``bypass``) its rollout correction can act."""
    from vespo.losses import get_loss

    try:
        spec = get_loss(loss.name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"loss.name: {e}") from None
    try:
        loss_cfg = spec.config_cls(**loss.options)
    except TypeError as e:
        valid = [f.name for f in dataclasses.fields(spec.config_cls)]
        raise ConfigError(f"loss.options for {loss.name!r}: {e}; valid options: {valid}") from None
    except ValueError as e:
        raise ConfigError(f"loss.options for {loss.name!r}: {e}") from None
    refusal = loss_cfg.bypass_refusal() if bypass else None
    if refusal:
        raise ConfigError(f"loss.options for {loss.name!r}: {refusal}")


# ---------------------------------------------------------------- output


def to_dict(cfg: Any) -> dict:
    """Plain data (YAML names) of a config, for run directories and checkpoints.

    A whole Config records its derived rollout batch and run length in ``rollout.prompts_per_step`` and
    ``run.steps`` (the values the run used; reading the dict back derives the same ones)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out[_yaml_name(f)] = to_dict(value) if dataclasses.is_dataclass(value) else value
    if isinstance(cfg, Config):
        out["rollout"]["prompts_per_step"], out["run"]["steps"] = cfg.prompts_per_step, cfg.steps
    return out


def added_at_default(dotted: str, value: Any) -> bool:
    """Whether ``value`` is the default of the field ``dotted`` (e.g. ``optim.ess_against``): a config written
    before that field existed lacks it, and the default keeps what such a config meant, so the two are the same
    condition (resume, and a sweep's archive, compare configs with this)."""
    node: Any = to_dict(Config())
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node == value


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted name, default, help) of every field, for `vespo train --help-config`."""
    rows = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{_yaml_name(f)}"
        if _is_section(cls, f):
            rows += describe(_field_type(cls, f), name + ".")
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            rule = {k: v for k, v in f.metadata.items() if k not in ("help", "yaml")}
            rows.append((name, default, f.metadata.get("help", "") + (f"  {rule}" if rule else "")))
    return rows
