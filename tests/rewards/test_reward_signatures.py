"""A reward file works as written for vespo, `f(completion, ground_truth)`, or for verl,
`compute_score(data_source, solution_str, ground_truth, extra_info=None)`: each row's data_source
and extra_info reach verl's, in process and in worker processes, through `vespo train` too. A batch
whose every reward fails stops `vespo train` with one line and exit status 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vespo
from vespo.config import AdvantageConfig
from vespo.data import PromptStream
from vespo.errors import RewardFnError
from vespo.models import build_char_tokenizer, tiny_model
from vespo.rewards import RewardScorer, RewardsFailedError, load_reward_fn
from vespo.rollout import HFEngine, SamplingParams
from vespo.trainer.producer import PromptSampler, RolloutScorer
from vespo.types import Problem

REWARDS = textwrap.dedent(
    """
    def exact(completion, ground_truth):
        return 1.0 if completion.strip() == str(ground_truth) else 0.0

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # verl's signature; the reward tells which row's data_source and extra_info it was given
        if data_source == "toy_math":
            return {"score": 1.0 if solution_str.strip() == ground_truth else 0.0, "acc": 0.5}
        extra_info["seen"] = True  # verl's reward managers hand over a dict the function may change
        return 10.0 * extra_info["index"] + (0.5 if data_source == "toy_text" else 0.0)

    def compute_score_kwargs(data_source, solution_str, ground_truth, **kwargs):
        return float(len(kwargs["extra_info"]))

    def compute_score_no_extra(data_source, solution_str, ground_truth):
        return 2.0 if data_source == "toy_text" else 3.0

    def broken_compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return extra_info["no_such_key"]

    def three_positional(a, b, c):
        return 0.0
    """
)

PROBLEMS = [
    Problem(id="a", prompt="1+1=", ground_truth="2", data_source="toy_math", extra_info={"index": 0}),
    Problem(id="b", prompt="say hi", ground_truth="hi", data_source="toy_text", extra_info={"index": 1}),
    Problem(id="c", prompt="say yo", ground_truth="yo", data_source="other", extra_info={"index": 2, "x": 1}),
]
COMPLETIONS = ["2", "hello", "yo"]


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A reward file written to tmp_path, importable here and in worker processes."""
    (tmp_path / "user_rewards_sig.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards_sig"
    sys.modules.pop("user_rewards_sig", None)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_verl_signature_gets_each_rows_data_source_and_extra_info(reward_module, num_workers):
    with RewardScorer(load_reward_fn(f"{reward_module}:compute_score"), num_workers=num_workers) as scorer:
        result = scorer.score_problems(COMPLETIONS, PROBLEMS)
    # row a: toy_math, a dict whose "score" is the reward; b: 10 * 1 + 0.5; c: 10 * 2
    assert result.rewards == [1.0, 10.5, 20.0] and result.errors == []
    assert "seen" not in PROBLEMS[1].extra_info  # the function got a copy
    fn = load_reward_fn(f"{reward_module}:compute_score_kwargs")
    assert RewardScorer(fn, num_workers=0).score_problems(COMPLETIONS, PROBLEMS).rewards == [1.0, 1.0, 2.0]
    fn = load_reward_fn(f"{reward_module}:compute_score_no_extra")
    assert RewardScorer(fn, num_workers=0).score_problems(COMPLETIONS, PROBLEMS).rewards == [3.0, 2.0, 3.0]


def test_vespo_signature_is_called_positionally(reward_module):
    scorer = RewardScorer(load_reward_fn(f"{reward_module}:exact"), num_workers=0)
    assert scorer.score_problems(COMPLETIONS, PROBLEMS).rewards == [1.0, 0.0, 1.0]
    assert scorer.score(COMPLETIONS, ["2", "hi", "no"]).rewards == [1.0, 0.0, 0.0]


def test_a_function_with_neither_signature_is_refused_when_loaded(reward_module):
    expected = (r"task.reward '\S+three_positional': reward function \S+three_positional\(a, b, c\) matches "
                r"neither accepted signature: f\(completion, ground_truth\)")
    with pytest.raises(ValueError, match=expected):
        load_reward_fn(f"{reward_module}:three_positional", field="task.reward")


def test_a_batch_whose_every_reward_fails_raises_naming_function_exception_and_signatures(reward_module):
    scorer = RewardScorer(load_reward_fn(f"{reward_module}:broken_compute_score"), num_workers=0)
    with pytest.raises(RewardsFailedError) as info:
        scorer.score_problems(COMPLETIONS, PROBLEMS)
    message = str(info.value)
    for part in ("every reward of a batch of 3 failed", "user_rewards_sig:broken_compute_score",
                 "KeyError: 'no_such_key'", "f(completion, ground_truth) -> float",
                 "compute_score(data_source, solution_str, ground_truth, extra_info=None)"):
        assert part in message, message
    assert "\n" not in message


# ---- `vespo train` with a reward file ----------------------------------------------------------------

FAST = ["model.size=nano", "warmstart.enabled=false", "task.eval_size=2", "rollout.prompts_per_step=4",
        "rollout.group_size=2", "staleness.n=1", "run.steps=1", "rollout.max_new_tokens=4", "run.progress=false",
        "run.loggers=[jsonl]", "run.threads=1"]


def vespo_train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`vespo train` in a subprocess that imports this checkout's vespo and the reward file in tmp_path."""
    source = str(Path(vespo.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "VESPO_DEBUG"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), source]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "vespo.cli", "train", *FAST, *overrides], check=False,
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200)


def verl_dataset(tmp_path: Path) -> Path:
    rows = [{"data_source": "toy_math" if i % 2 else "toy_text", "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"ground_truth": str(i + 1)}, "extra_info": {"index": i, "split": "train"}}
            for i in range(20)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_vespo_train_with_a_verl_reward_file(tmp_path, reward_module):
    done = vespo_train(tmp_path, f"task.dataset={verl_dataset(tmp_path)}",
                       f"task.reward={reward_module}:compute_score", f"run.out_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = {m["reward/mean"] for m in metrics if "reward/mean" in m}
    assert rewards and all(r > 0 for r in rewards)  # toy_text rows score 10 * index + 0.5 > 0
    assert all(m.get("reward/failed", 0.0) == 0.0 for m in metrics)


def test_vespo_train_stops_with_exit_2_when_every_reward_fails(tmp_path, reward_module):
    done = vespo_train(tmp_path, f"task.dataset={verl_dataset(tmp_path)}",
                       f"task.reward={reward_module}:broken_compute_score", f"run.out_dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("vespo train: error: every reward of a batch of"), line
    for part in ("user_rewards_sig:broken_compute_score", "KeyError", "f(completion, ground_truth)",
                 "compute_score(data_source, solution_str, ground_truth, extra_info=None)"):
        assert part in line, line


def test_the_rollout_scorer_refuses_a_batch_without_one_reward():
    """Whatever reward function the scorer is given, a batch where none scored (all NaN) stops with a
    user error, not a failure deep in the advantage code."""
    tok = build_char_tokenizer()
    engine = HFEngine(tiny_model("qwen3", "nano", tokenizer=tok, seed=0), tok)
    seen = []

    def nan_rewards(completions, problems):
        seen.append([p.id for p in problems])
        return [math.nan] * len(completions)

    prompts = PromptSampler(tok, PromptStream(PROBLEMS, seed=0), group_size=2).sample(2, first_group_id=0)
    rollout = engine.generate(prompts.prompt_ids, SamplingParams(max_new_tokens=3), seed=0)
    scorer = RolloutScorer(tok, nan_rewards, group_size=2, advantage=AdvantageConfig())
    with pytest.raises(RewardFnError, match="every reward of a rollout batch of 4 failed"):
        scorer.score(prompts, rollout)
    assert len(seen) == 1 and len(seen[0]) == 4 and seen[0][0] == seen[0][1]  # each problem G = 2 times
