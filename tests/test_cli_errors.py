"""User errors from the `vespo` command: one line on stderr naming the field, file or row, exit
status 2, no traceback (unless --debug or VESPO_DEBUG=1). Each case fails before training starts."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vespo import cli
from vespo.config import load_config
from vespo.errors import one_line
from vespo.trainer import train

FAST = ["model.size=nano", "warmstart.enabled=false", "task.eval_size=4", "task.train_size=64",
        "rollout.prompts_per_step=4", "rollout.group_size=2", "staleness.n=1", "run.steps=1",
        "run.progress=false", "run.loggers=[jsonl]", "run.threads=1"]


def vespo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m vespo.cli ARGS` with VESPO_DEBUG unset unless ``env`` sets it."""
    base = {k: v for k, v in os.environ.items() if k != "VESPO_DEBUG"}
    return subprocess.run([sys.executable, "-m", "vespo.cli", *args], capture_output=True, text=True,
                          env={**base, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=300)


def assert_one_line(done: subprocess.CompletedProcess, command: str, *names: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"vespo {command}: error: ")
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD_ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]


def test_a_malformed_dataset_row_names_file_and_row(tmp_path):
    data = write_rows(tmp_path / "train.jsonl", [GOOD_ROWS[0], '{"prompt": "1+1=", "answer": ', GOOD_ROWS[1]])
    done = vespo("train", *FAST, f"task.dataset={data}", "rollout.max_new_tokens=4", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "train.jsonl", "row 2", "not valid JSON")
    data = write_rows(tmp_path / "fields.jsonl", [GOOD_ROWS[0], {"prompt": "2+2="}])
    done = vespo("train", *FAST, f"task.dataset={data}", "rollout.max_new_tokens=4", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "fields.jsonl", "row 2", "'reward_model.ground_truth' (or 'answer') is missing")


def test_a_dataset_without_max_new_tokens_names_the_field(tmp_path):
    data = write_rows(tmp_path / "train.jsonl", GOOD_ROWS)
    done = vespo("train", *FAST, f"task.dataset={data}", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "rollout.max_new_tokens")


@pytest.mark.parametrize("override, names", [
    ("staleness.n=0", ["staleness.n must be >= 1, got 0"]),
    ("optim.lrr=1", ["unknown field 'optim.lrr'"]),
    ("loss.name=vespoo", ["loss.name", "unknown loss 'vespoo'; choose one of:"]),
    ("task.name=additon", ["unknown task 'additon'; choose one of:"]),
])
def test_bad_config_values_name_the_field(tmp_path, override, names):
    done = vespo("train", *FAST, override, f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", *names)


def test_a_correction_that_cannot_act_is_refused(tmp_path):
    """mu = the engine's log-probs: GRPO's ratio already is pi/pi_rollout, so a truncation on top is refused."""
    done = vespo("train", *FAST, "staleness.behavior=rollout", "loss.name=grpo",
                 "loss.options={rollout_correction: {mode: tis_token}}", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "loss.options", "tis_token", "cannot act with mu = the engine's log-probs")


def test_a_bad_reward_import_path_names_the_path(tmp_path):
    done = vespo("train", *FAST, "task.reward=no_such_module_xyz:score", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "'no_such_module_xyz:score'", "cannot import module 'no_such_module_xyz'")


def test_an_existing_run_directory_says_to_resume_or_move(tmp_path):
    out = tmp_path / "run"
    train(load_config(None, FAST + ["task.name=addition", "task.options={digits: 1}", f"run.out_dir={out}"]))
    done = vespo("train", *FAST, "task.options={digits: 1}", f"run.out_dir={out}")
    assert_one_line(done, "train", str(out), "already holds a run", "--resume", "run.out_dir")


def test_eval_errors_name_the_option(tmp_path):
    missing = tmp_path / "no_such_policy"
    assert_one_line(vespo("eval", "--model", str(missing), "--task", "addition"), "eval", str(missing),
                    "is not a directory")
    assert_one_line(vespo("eval", "--model", str(missing), "--task", "additon"), "eval", "--task 'additon'",
                    "unknown task")


def test_debug_shows_the_traceback(tmp_path):
    for args, env in ((["--debug", "train", "staleness.n=0"], None), (["train", "staleness.n=0", "--debug"], None),
                      (["train", "staleness.n=0"], {"VESPO_DEBUG": "1"})):
        done = vespo(*args, env=env)
        assert done.returncode == 2
        assert "Traceback" in done.stderr and "ConfigError" in done.stderr, args
        assert done.stderr.strip().splitlines()[-1] == "vespo train: error: staleness.n must be >= 1, got 0"


@pytest.fixture
def command_module(tmp_path, monkeypatch):
    """A `vespo boom ARG` subcommand that raises what ARG names: a user error or an unexpected one."""
    (tmp_path / "boom_command.py").write_text(textwrap.dedent("""
        from vespo.errors import DataError

        def main(argv):
            if argv == ["user"]:
                raise DataError("data.jsonl: row 3: field 'prompt' is missing\\nsecond line")
            raise RuntimeError("an unexpected failure")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "boom", ("boom_command", "raise"))
    monkeypatch.delenv("VESPO_DEBUG", raising=False)


def test_unexpected_failures_keep_their_traceback(command_module, capsys):
    assert cli.main(["boom", "user"]) == 2
    assert capsys.readouterr().err == "vespo boom: error: data.jsonl: row 3: field 'prompt' is missing; second line\n"
    with pytest.raises(RuntimeError, match="an unexpected failure"):
        cli.main(["boom", "other"])


def test_one_line_joins_lines():
    assert one_line(ValueError("a\n  b\n\nc")) == "a; b; c"
    assert one_line(ValueError()) == "ValueError"
