"""LoRA (model.lora) through the real trainer on the nano model: only the adapters train, the frozen base stays bit
for bit, the engine holds the learner's weights after every adapter-only push (sync and async worker), the merged
policy directory loads with plain transformers (and the adapter directory with peft) and reproduces the learner's
log-probs, a resumed run continues as an uninterrupted one, and settings that cannot act are refused."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vespo.config import ConfigError, LoraConfig, check_rules, to_dict
from vespo.metrics import read_jsonl
from vespo.models import response_logprobs, tiny_model
from vespo.models.lora import adapter_state, attach_lora, base_state, is_adapter_key
from vespo.trainer import train
from vespo.trainer.checkpoint import latest_checkpoint
from vespo.trainer.learner import Learner
from vespo.trainer.run import build_run
from vespo.trainer.sources import LocalSource
from vespo.trainer.warmstart import _cache_path

pytest.importorskip("peft")

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "optim.lr=3e-3")


def _bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def _learner(make_cfg, *overrides, out="run"):
    cfg = make_cfg(*LORA, *overrides, out=out)
    run = build_run(cfg, log=lambda *a, **k: None)
    learner = Learner(run.policy, cfg)
    return run, learner, LocalSource(run, learner, engine=run.make_engine(run.policy))


def _gap(engine, learner: Learner, prompt_ids: list[list[int]], sampling, seed: int = 3) -> float:
    """The largest |engine log-prob - learner log-prob| over the tokens the engine samples for ``prompt_ids``."""
    r = engine.generate(prompt_ids, sampling, seed=seed)
    with torch.no_grad():
        logp, _ = response_logprobs(learner.model, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask,
                                    with_entropy=False)
    valid = r.response_mask > 0
    return float((r.logprobs[valid] - logp[valid]).abs().max())


def _train_one_batch(source: LocalSource, learner: Learner) -> None:
    items = source.next()
    learner.prepare(items)
    for item in items:
        learner.update(item)


def test_only_the_adapters_train_and_the_engine_follows_adapter_only_pushes(make_cfg):
    run, learner, source = _learner(make_cfg)
    base_before = {k: v.clone() for k, v in base_state(run.policy).items()}  # on the CPU the states alias the weights
    adapters_before = {k: v.clone() for k, v in adapter_state(run.policy).items()}
    trained = {n for n, p in learner.module.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter_key(n) for n in trained)
    assert {id(p) for p in learner.params} == {id(p) for n, p in learner.module.named_parameters() if is_adapter_key(n)}

    _train_one_batch(source, learner)
    assert all(p.grad is None and not p.requires_grad
               for n, p in learner.module.named_parameters() if not is_adapter_key(n))
    assert len(learner.optimizer.state) == len(learner.params)  # AdamW moments of the adapters, nothing else
    memory, adapter_bytes = learner.memory(), _bytes(adapter_state(run.policy))
    assert 2 * adapter_bytes <= memory["mem/optim_bytes_per_rank"] < 3 * adapter_bytes  # two moments (and a step)
    assert memory["mem/param_bytes_per_rank"] == _bytes(adapter_state(run.policy)) + _bytes(
        {n: p for n, p in run.policy.named_parameters() if not is_adapter_key(n)})  # the frozen base counted too

    base_after, adapters_after = base_state(run.policy), adapter_state(run.policy)
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)  # the frozen base, bit for bit
    assert all(not torch.equal(adapters_before[k], adapters_after[k]) for k in adapters_before if ".lora_B." in k)

    # the push: the adapters only (a fraction of the weights), and the engine then samples with the learner's policy
    pushed = learner.weights()
    targets = [m.get_base_layer() for name, m in run.policy.named_modules()
               if name.rsplit(".", 1)[-1] in run.cfg.model.lora.target_modules]
    expected = sum(4 * (t.in_features + t.out_features) * t.weight.element_size() for t in targets)  # r (in + out)
    assert pushed.keys() == adapters_after.keys() and _bytes(pushed) == expected < _bytes(base_after)
    prompts = source.sampler.sample(4, first_group_id=0).prompt_ids
    source._sync_engine()
    assert source.engine.version == learner.version == 2
    assert _gap(source.engine, learner, prompts, run.sampling) < 1e-5
    stale = run.make_engine(run.policy)  # the same engine with the adapters before the updates
    stale.load_weights(adapters_before, 0)
    assert _gap(stale, learner, prompts, run.sampling) > 1e-3  # the push closed a real gap


def test_the_async_worker_builds_on_the_base_and_takes_adapter_only_pushes(make_cfg):
    from vespo.trainer.workers import RolloutWorker

    run, learner, source = _learner(make_cfg)
    _train_one_batch(source, learner)
    worker = RolloutWorker(to_dict(run.cfg), run.sampling, 0, base=base_state(run.policy))
    worker.set_weights(learner.weights(), learner.version, 0)
    assert worker._load_pending() == 1 and worker.engine.version == learner.version
    prompts = source.sampler.sample(4, first_group_id=0).prompt_ids
    assert _gap(worker.engine, learner, prompts, run.sampling) < 1e-5
    # built without the base, the worker's engine holds the seed's weights, not the warm-started base
    bare = RolloutWorker(to_dict(run.cfg), run.sampling, 0)
    bare.set_weights(learner.weights(), learner.version, 0)
    bare._load_pending()
    assert _gap(bare.engine, learner, prompts, run.sampling) > 1e-3


def test_a_lora_run_exports_a_merged_policy_and_the_adapter_that_reproduce_the_learner(make_cfg):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(*LORA, "run.steps=2")
    seen = {}
    summary = train(cfg, on_update=lambda loop: seen.update(loop=loop))
    assert summary["status"] == "done"
    learner = seen["loop"].learner
    run_dir = Path(cfg.run.out_dir)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "policy").eval()  # plain transformers: no adapters
    assert not any("lora" in k for k in merged.state_dict())
    base = tiny_model(arch=cfg.model.arch, size=cfg.model.size, tokenizer=seen["loop"].run.tokenizer, seed=cfg.run.seed)
    base.load_state_dict(load_file(str(_cache_path(cfg))))  # the warm-started weights the adapters sit on
    g = torch.Generator().manual_seed(0)
    prompt_ids, response_ids = torch.randint(3, 40, (4, 6), generator=g), torch.randint(3, 40, (4, 5), generator=g)
    masks = torch.ones(4, 6, dtype=torch.long), torch.ones(4, 5)
    with torch.no_grad():
        expected = response_logprobs(learner.model.eval(), prompt_ids, masks[0], response_ids, masks[1])[0]
        from_base = response_logprobs(base, prompt_ids, masks[0], response_ids, masks[1])[0]
        from_merged = response_logprobs(merged, prompt_ids, masks[0], response_ids, masks[1])[0]
        with_adapter = PeftModel.from_pretrained(base, run_dir / "adapter").eval()  # the adapters put on the base
        from_adapter = with_adapter(torch.cat([prompt_ids, response_ids], 1)).logits.log_softmax(-1)
    from_adapter = from_adapter[:, 5:-1].gather(-1, response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(from_merged, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(from_adapter, expected, rtol=0, atol=1e-5)
    assert (expected - from_base).abs().max() > 1e-3  # the adapters trained: the policy is not its base


def test_a_resumed_lora_run_continues_as_an_uninterrupted_one(make_cfg):
    full = make_cfg(*LORA, "run.steps=4", "run.checkpoint_every=2", out="full")
    train(full)
    train(make_cfg(*LORA, "run.steps=2", "run.checkpoint_every=2", out="part"))
    part = make_cfg(*LORA, "run.steps=4", "run.checkpoint_every=2", out="part")
    train(part, resume=True)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # noqa: E731
    a, b = (strip(read_jsonl(f"{c.run.out_dir}/metrics.jsonl")) for c in (full, part))
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a == b
    for c in (full, part):
        assert latest_checkpoint(c.run.out_dir).name == "step-000004"
    merged = [load_file(f"{c.run.out_dir}/policy/model.safetensors") for c in (full, part)]
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])
    adapters = [load_file(f"{c.run.out_dir}/adapter/adapter_model.safetensors") for c in (full, part)]
    assert adapters[0].keys() == adapters[1].keys() and all(torch.equal(adapters[0][k], adapters[1][k])
                                                           for k in adapters[0])
    # a LoRA run's checkpoint evaluates as its merged policy
    from vespo.trainer.policy_dir import policy_from_checkpoint

    model, _ = policy_from_checkpoint(latest_checkpoint(part.run.out_dir))
    assert all(torch.equal(model.state_dict()[k], merged[1][k]) for k in merged[1])
    assert json.loads((Path(part.run.out_dir) / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_lora_settings_that_cannot_act_are_refused(make_cfg):
    with pytest.raises(ConfigError, match="model.lora.alpha differs from its default but model.lora.rank=0"):
        make_cfg("model.lora.alpha=8")
    with pytest.raises(ConfigError, match="model.lora needs rollout.engine=hf"):
        make_cfg("model.lora.rank=4", "rollout.engine=vllm")
    with pytest.raises(ConfigError, match="2 processes would shard it"):
        check_rules(make_cfg("model.lora.rank=4"), 2, torchrun=True)
    with pytest.raises(ConfigError, match="2 processes would shard it"):
        make_cfg("model.lora.rank=4", "run.mode=async", "async.learner=actor", "async.learner_workers=2")
    cfg = make_cfg("model.lora.rank=4", "model.lora.target_modules=[q_proj, qkv_proj]")
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['qkv_proj'\] match no module"):
        build_run(cfg, log=lambda *a, **k: None)
    with pytest.raises(ConfigError, match="tied embedding"):
        attach_lora(tiny_model(size="nano", vocab_size=64), LoraConfig(rank=2, target_modules=["lm_head"]))


def test_an_async_lora_run_pushes_the_adapters_only(make_cfg, monkeypatch):
    """Through Ray: the workers are built once with the base; every push is the adapters' size, and the engine's
    log-probs stay the learner's (the behaviour pass compares them on every mini-batch)."""
    import ray

    from vespo.trainer.ray_source import RaySource

    pushed: list[int] = []
    push = RaySource.push_weights

    def measured(self):
        push(self)
        pushed.append(_bytes(ray.get(self.weights_ref)))

    cfg = make_cfg(*LORA, "run.mode=async", "async.chunk_tokens=1", "async.stall_timeout_s=600", "run.steps=2",
                   "async.sync_every=1", "async.max_staleness=0", "async.workers=1")  # every row at lag 0
    seen = {}
    monkeypatch.setattr(RaySource, "push_weights", measured)  # the real push, and the size of what it put
    summary = train(cfg, on_update=lambda loop: seen.setdefault("policy", loop.run.policy))
    assert summary["status"] == "done" and summary["weight_pushes"] == len(pushed) >= 4
    adapters, base = _bytes(adapter_state(seen["policy"])), _bytes(base_state(seen["policy"]))
    assert set(pushed) == {adapters} and adapters < base
    rows = read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["staleness/lag_max"] == 0 for r in rows)
    assert max(r["mismatch/abs_diff_max"] for r in rows) < 1e-4  # the engine holds the base + the pushed adapters


def test_activation_checkpointing_trains_the_same_adapters(make_cfg):
    """model.gradient_checkpointing with LoRA: the frozen layers recompute in backward, the adapters' update is the
    same (the checkpointed forward's gradients reach the adapters through frozen inputs)."""
    states = []
    for gc in ("false", "true"):
        run, learner, source = _learner(make_cfg, f"model.gradient_checkpointing={gc}", out=f"gc-{gc}")
        _train_one_batch(source, learner)
        states.append({k: v.clone() for k, v in adapter_state(run.policy).items()})
    assert all(not torch.equal(v, torch.zeros_like(v)) for k, v in states[1].items() if ".lora_B." in k)
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=0, atol=1e-6)


def test_an_own_engine_generates_with_the_adapters_merged_and_merges_again_from_the_frozen_base(make_cfg):
    """The engine's copy decodes with W + (alpha / r) B A in its weights (peft's adapter path never runs while it
    samples), its log-probs stay the learner's, the learner's base is untouched, and merging after each push starts
    from W: pushing the old adapters back gives the first merge's weights bit for bit (no drift)."""
    from peft.tuners.lora import LoraLayer

    from vespo.models.lora import merged_state

    run, learner, source = _learner(make_cfg)
    base_before = {k: v.clone() for k, v in base_state(run.policy).items()}
    first = learner.weights()
    first = {k: v.clone() for k, v in first.items()}
    _train_one_batch(source, learner)
    engine = run.make_engine(run.policy)
    adapter_calls = []
    for layer in (m for m in engine.model.modules() if isinstance(m, LoraLayer)):
        layer.lora_A.default.register_forward_hook(lambda *a: adapter_calls.append(1))
    prompts = source.sampler.sample(4, first_group_id=0).prompt_ids
    assert _gap(engine, learner, prompts, run.sampling) < 1e-5
    assert adapter_calls == []  # every token decoded through the merged weights alone
    merged = merged_state(learner.model)
    own = {k.replace(".base_layer.", "."): v for k, v in engine.model.state_dict().items() if not is_adapter_key(k)}
    assert all(torch.equal(own[k], merged[k]) for k in merged)  # W + (alpha / r) B A, formed as the export forms it
    assert all(torch.equal(base_before[k], v) for k, v in base_state(run.policy).items())  # the learner's base

    engine.load_weights(first, learner.version + 1)  # the adapters before the update: back to the first merge
    again = run.make_engine(run.policy)
    again.load_weights(first, learner.version + 1)
    fresh = {k: v for k, v in again.model.state_dict().items()}
    assert all(torch.equal(v, fresh[k]) for k, v in engine.model.state_dict().items())
    assert _gap(engine, learner, prompts, run.sampling) > 1e-3  # the old adapters: not the learner's policy


def test_a_bf16_engine_merges_from_the_float32_base_and_adapters(make_cfg):
    """In bfloat16 the merged weight is bf16(W + (alpha / r) B A) with the sum in float32 (the merged policy cast
    once), not a sum of bf16 parts, and its log-probs stay within bf16's reach of the learner's."""
    from vespo.models.lora import merged_state

    run, learner, source = _learner(make_cfg, "rollout.engine_dtype=bfloat16")
    _train_one_batch(source, learner)
    engine = run.make_engine(run.policy)
    engine.load_weights(learner.weights(), learner.version)
    merged = merged_state(learner.model)
    own = {k.replace(".base_layer.", "."): v for k, v in engine.model.state_dict().items() if not is_adapter_key(k)}
    assert all(torch.equal(own[k], merged[k].to(torch.bfloat16)) for k in merged)
    prompts = source.sampler.sample(4, first_group_id=0).prompt_ids
    assert _gap(engine, learner, prompts, run.sampling) < 0.1
