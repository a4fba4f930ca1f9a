"""A resume that never loses data: when checkpoints/latest is missing, empty, dangling or unreadable, or names a
damaged checkpoint (a truncated trainer.pt or dcp shard), the run continues from the newest checkpoint that
verifies, says which, and ends bit for bit as an uninterrupted run; a run directory with no checkpoint that
verifies is refused with every file left as it was; a moved run directory resumes; one process per run directory."""

import hashlib
import shutil
from pathlib import Path

import pytest

from vespo.config import load_config
from vespo.errors import CheckpointError, ResumeError, RunDirError
from vespo.metrics import read_jsonl
from vespo.trainer import train
from vespo.trainer.checkpoint import load_checkpoint, resume_point
from vespo.trainer.runlog import hold_run_dir

BASE = ["model.size=nano", "task.name=addition", "task.options={digits: 1}", "task.train_size=500",
        "task.eval_size=8", "rollout.prompts_per_step=4", "rollout.group_size=4", "staleness.n=2",
        "warmstart.enabled=false", "optim.lr=1e-3", "run.steps=3", "run.checkpoint_every=1", "run.progress=false",
        "run.loggers=[jsonl]", "run.threads=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(make a config in this module's folder, the folder): an uninterrupted 4-step run ("reference") and a
    3-step run ("three", checkpoints at steps 2 and 3) to copy and damage."""
    root = tmp_path_factory.mktemp("fallback")

    def cfg(out: str, *more: str):
        return load_config(None, BASE + [f"run.out_dir={root / out}", *more])

    train(cfg("reference", "run.steps=4"))
    train(cfg("three"))
    return cfg, root


def _comparable(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_jsonl(path)]


def _files(run_dir: Path) -> dict[str, str]:
    """Every file of a run directory (but the lock) and a hash of its bytes."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _shard(step_dir: Path) -> Path:
    return next((step_dir / "dcp").glob("*.distcp"))


DAMAGE = {  # what is done to the copy of "three", what the note must say, the step the run resumes from
    "latest missing": (lambda c: (c / "latest").unlink(), "checkpoints/latest is missing", 3),
    "latest empty": (lambda c: (c / "latest").write_text(""), "checkpoints/latest is empty", 3),
    "latest dangling": (lambda c: (c / "latest").write_text("step-000009"),
                        "checkpoints/latest names step-000009, which does not exist", 3),
    "latest unreadable": (lambda c: (c / "latest").write_bytes(b"\xff\xfe\x00"),
                          "checkpoints/latest cannot be read", 3),
    "trainer.pt truncated": (lambda c: _truncate(c / "step-000003" / "trainer.pt"),
                             "names step-000003, which is damaged", 2),
    "shard truncated": (lambda c: _truncate(_shard(c / "step-000003")), "is truncated", 2),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(runs, case, capsys):
    cfg, root = runs
    damage, said, step = DAMAGE[case]
    out = root / case.replace(" ", "_")
    shutil.copytree(root / "three", out)
    damage(out / "checkpoints")
    capsys.readouterr()
    summary = train(cfg(out.name, "run.steps=4"), resume=True)
    err = capsys.readouterr().err
    note = next(line for line in err.splitlines() if line.startswith("--resume: "))
    assert said in note and f"resuming from {out / 'checkpoints' / f'step-{step:06d}'}" in note, note
    assert summary["status"] == "done" and summary["steps_done"] == 4
    assert _comparable(out / "metrics.jsonl") == _comparable(root / "reference" / "metrics.jsonl")


def test_a_run_with_no_checkpoint_that_verifies_is_refused_and_left_as_it_was(runs):
    cfg, root = runs
    out = root / "all_damaged"
    shutil.copytree(root / "three", out)
    for step_dir in (out / "checkpoints").glob("step-*"):
        _truncate(_shard(step_dir))
    before = _files(out)
    with pytest.raises(ResumeError, match=r"holds a run .* no checkpoint to continue it from .*is truncated.*nothing "
                                          r"was changed") as refused:
        train(cfg(out.name, "run.steps=4"), resume=True)
    assert "another model" not in str(refused.value)
    assert _files(out) == before
    with pytest.raises(CheckpointError, match=r"shard .*__0_0.distcp is truncated \(\d+ of \d+ bytes\)"):
        load_checkpoint(out / "checkpoints" / "step-000003", torch_module(cfg))


def torch_module(cfg):
    from vespo.trainer.run import build_policy

    return build_policy(cfg("unused"))[0]


def test_a_run_with_rows_but_no_checkpoint_is_refused_not_started_over(runs):
    cfg, root = runs
    out = root / "no_checkpoint"
    shutil.copytree(root / "three", out)
    shutil.rmtree(out / "checkpoints")
    before = _files(out)
    with pytest.raises(ResumeError, match=r"holds a run \(metrics.jsonl, 3 rows\) but no checkpoint .*move this one "
                                          r"away"):
        train(cfg(out.name, "run.steps=4"), resume=True)
    assert _files(out) == before


def test_a_moved_run_directory_resumes(runs, tmp_path):
    cfg, root = runs
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(root / "three", moved)
    assert resume_point(moved) == (moved / "checkpoints" / "step-000003", None)
    summary = train(load_config(None, BASE + [f"run.out_dir={moved}", "run.steps=4"]), resume=True)
    assert summary["steps_done"] == 4
    assert _comparable(moved / "metrics.jsonl") == _comparable(root / "reference" / "metrics.jsonl")


def test_a_run_directory_in_use_is_refused_in_one_line_and_left_as_it_was(runs):
    cfg, root = runs
    out = root / "in_use"
    shutil.copytree(root / "three", out)
    before = _files(out)
    with hold_run_dir(out):  # the lock another process's run holds (fcntl.flock: per open file, so also here)
        with pytest.raises(RunDirError, match=r"run directory .*in_use is in use by another vespo process \(pid \d+\)"):
            train(cfg(out.name, "run.steps=4"), resume=True)
    assert _files(out) == before
