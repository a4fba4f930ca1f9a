"""A resume that always works: --resume before the first row starts the run from the beginning, and a
sync run SIGKILLed at any moment (before its first row, during a checkpoint write, at random)
and resumed ends with the weights and metrics of an uninterrupted run, bit for bit."""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from vespo.metrics import read_jsonl
from vespo.trainer import train
from vespo.trainer.checkpoint import latest_checkpoint


def _comparable(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_jsonl(path)]


def test_resume_before_the_first_row_starts_from_the_beginning(make_cfg, capsys):
    reference = make_cfg("run.steps=2", out="reference")
    train(reference)
    cfg = make_cfg("run.steps=2", out="run")
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")  # a run killed before its first row: nothing to lose
    summary = train(cfg, resume=True)
    assert "no checkpoint" in capsys.readouterr().err
    assert summary["status"] == "done" and summary["steps_done"] == 2
    assert _comparable(out / "metrics.jsonl") == _comparable(Path(reference.run.out_dir) / "metrics.jsonl")


OVERRIDES = ["model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=2000",
             "task.eval_size=16", "rollout.prompts_per_step=8", "rollout.group_size=4", "staleness.n=2",
             "warmstart.steps=20", "warmstart.batch_size=32", "optim.lr=1e-3", "run.steps=10",
             "run.checkpoint_every=1", "run.log_samples_every=1", "run.progress=false", "run.loggers=[jsonl]",
             "run.threads=1"]


def _launch(out: Path, cache: Path) -> subprocess.Popen:
    args = OVERRIDES + [f"run.out_dir={out}", f"warmstart.cache_dir={cache}"]
    return subprocess.Popen([sys.executable, "-m", "vespo.cli", "train", "--resume", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen, condition, timeout_s: float = 300.0) -> bool:
    """SIGKILL ``proc`` the moment ``condition()`` holds; False if the run ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.0005)
    proc.kill()
    raise AssertionError("the run neither reached the kill point nor finished")


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_matches_an_uninterrupted_run(tmp_path):
    cache = tmp_path / "warmstart"
    reference = tmp_path / "reference"
    proc = _launch(reference, cache)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()

    out = tmp_path / "killed"
    metrics, ckpts = out / "metrics.jsonl", out / "checkpoints"
    # a run killed after its first row and before its first checkpoint is refused --resume (it would start over;
    # test_resume_fallback.py): the kill points here are before the first row and after the first checkpoint
    kill_points = {
        "before the first row": lambda: metrics.exists() and metrics.stat().st_size == 0,
        "during a checkpoint write": lambda: (ckpts / "latest").is_file() and any(
            p.suffix == ".tmp" for p in ckpts.iterdir()),
    }
    rng = random.Random(0)
    killed = []
    for name, condition in kill_points.items():
        for _ in range(5):  # a checkpoint write takes milliseconds: retry until one is caught
            if _kill_when(_launch(out, cache), condition):
                killed.append(name)
                break
    for _ in range(3):  # and at random moments (a checkpoint stands by now)
        proc = _launch(out, cache)
        time.sleep(rng.uniform(2.0, 6.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed.append("random")
    assert killed[:2] == list(kill_points), killed
    proc = _launch(out, cache)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()

    assert json.loads((out / "summary.json").read_text())["status"] == "done"
    assert _comparable(metrics) == _comparable(reference / "metrics.jsonl")
    assert read_jsonl(out / "samples.jsonl") == read_jsonl(reference / "samples.jsonl")
    assert latest_checkpoint(out).name == latest_checkpoint(reference).name
    policy, policy_ref = load_file(out / "policy" / "model.safetensors"), load_file(reference / "policy" / "model.safetensors")
    assert all((policy[k] == policy_ref[k]).all() for k in policy_ref)


def test_a_field_newer_than_the_run_at_its_default_is_the_same_config(tmp_path):
    """A checkpoint written before optim.ess_against existed resumes under today's default (mu, what the run
    did); the field set to another value is another config, refused."""
    import json

    from vespo.config import load_config, to_dict
    from vespo.errors import ResumeError
    from vespo.trainer.checkpoint import CONFIG_FILE, check_resume_config

    now = to_dict(load_config(None, []))
    old = json.loads(json.dumps(now))
    del old["optim"]["ess_against"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(old))
    check_resume_config(tmp_path, now)
    changed = to_dict(load_config(None, ["optim.ess_scaled_lr=true", "optim.ess_against=engine"]))
    old["optim"]["ess_scaled_lr"] = True
    (tmp_path / CONFIG_FILE).write_text(json.dumps(old))
    with pytest.raises(ResumeError, match="optim.ess_against"):
        check_resume_config(tmp_path, changed)
