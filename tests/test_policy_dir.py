"""A trained run leaves a policy that plain transformers and `vespo eval` load: RUN_DIR/policy/
(save_pretrained layout), a run directory, or a checkpoint directory."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from vespo.config import load_config, to_dict
from vespo.models import build_char_tokenizer, tiny_model
from vespo.trainer import train
from vespo.trainer.checkpoint import latest_checkpoint
from vespo.trainer.policy_dir import load_trained_policy, policy_from_checkpoint, policy_weights, save_run_policy

PROMPTS = ["3+4=", "9+0=", "1+8="]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """Two real training steps of the nano policy on 1-digit addition; (run dir, config)."""
    root = tmp_path_factory.mktemp("policy_run")
    cfg = load_config(None, [
        "model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=200",
        "task.eval_size=8", "rollout.prompts_per_step=4", "rollout.group_size=4", "staleness.n=2",
        "warmstart.steps=5", "warmstart.batch_size=32", f"warmstart.cache_dir={root / 'warm'}",
        "optim.lr=1e-3", "run.steps=2", "run.progress=false", "run.loggers=[jsonl]", "run.threads=1",
        f"run.out_dir={root / 'run'}"])
    train(cfg)
    return Path(cfg.run.out_dir), cfg


def trained_logits(cfg, checkpoint: Path) -> torch.Tensor:
    """Logits [3, T, V] of the trained weights as the trainer wrote them, in a model built here."""
    tok = build_char_tokenizer()
    model = tiny_model(cfg.model.arch, cfg.model.size, tokenizer=tok, seed=cfg.run.seed)
    policy_weights(checkpoint, model)  # the weights the trainer checkpointed (dcp shards)
    with torch.no_grad():
        return model(**tok(PROMPTS, return_tensors="pt")).logits


def test_the_policy_directory_loads_with_plain_transformers(trained_run, tmp_path):
    run_dir, cfg = trained_run
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.name == "step-000002"
    assert (checkpoint / "run_config.json").is_file() and not (checkpoint / "config.json").exists()

    # the run wrote RUN_DIR/policy/ at its end; a run directory without one (a run killed before its
    # end) means its latest checkpoint
    policy = run_dir / "policy"
    _, _, loaded = load_trained_policy(run_dir)
    assert str(policy) in loaded
    bare = tmp_path / "bare_run"
    shutil.copytree(run_dir, bare, ignore=shutil.ignore_patterns("policy"))
    model, _, loaded = load_trained_policy(bare)
    assert "its latest checkpoint" in loaded and str(latest_checkpoint(bare)) in loaded
    model, tok = policy_from_checkpoint(latest_checkpoint(bare))
    rewritten = save_run_policy(bare, model, tok, to_dict(cfg))
    assert load_file(str(rewritten / "model.safetensors")).keys() == load_file(str(policy / "model.safetensors")).keys()

    names = {p.name for p in policy.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "run_config.json"} <= names
    assert not any(n.endswith(".bin") for n in names)
    hf_model = AutoModelForCausalLM.from_pretrained(policy)
    hf_tok = AutoTokenizer.from_pretrained(policy)
    reference_tok = build_char_tokenizer()
    assert hf_tok(PROMPTS)["input_ids"] == reference_tok(PROMPTS)["input_ids"]
    assert (hf_tok.pad_token, hf_tok.eos_token, hf_tok.padding_side) == ("<pad>", "<eos>", "left")
    assert hf_tok.decode(hf_tok("12+3=")["input_ids"]) == "12+3="
    with torch.no_grad():
        logits = hf_model(**hf_tok(PROMPTS, return_tensors="pt")).logits
    assert torch.equal(logits, trained_logits(cfg, checkpoint))
    assert json.loads((policy / "run_config.json").read_text())["run"]["steps"] == 2


def vespo_eval(model: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "vespo.cli", "eval", "--model", str(model), "--task", "addition",
               "--task-arg", "digits=1", "--n-problems", "6", "--default-k", "2", "--num-workers", "0",
               "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)


def test_vespo_eval_takes_a_run_directory_or_a_checkpoint(trained_run, tmp_path):
    run_dir, cfg = trained_run
    assert (run_dir / "policy" / "config.json").is_file()  # the policy the loop writes at the end of a run
    results = {}
    for name, model_path in (("run", run_dir), ("checkpoint", latest_checkpoint(run_dir))):
        done = vespo_eval(model_path, tmp_path / f"{name}.jsonl")
        assert done.returncode == 0, done.stderr
        results[name] = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert "policy: " in done.stderr and "(a checkpoint)" in done.stderr
    assert results["run"][0]["type"] == "source" and results["run"][0]["num_problems"] == 6
    # the same weights and seed: the run's policy/ and its last checkpoint sample the same completions
    assert results["run"] == results["checkpoint"]
