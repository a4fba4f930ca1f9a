"""A miniature sweep on the paper's protocol (grpo, vespo x N in {1, 4} x 1 seed, nano model, 4
optimizer steps per run) end to end: `vespo sweep` runs real `vespo train` processes and records
its session, a second call skips them, `vespo report` writes the report and the results page."""

import json
import re
from pathlib import Path

import pytest
import yaml

from vespo.lab import report
from vespo.lab import cli as report_cli
from vespo.lab.grid import SweepError, load_sweep
from vespo.sweep import plan, provenance
from vespo.sweep import cli as sweep_cli

QUICK = Path(__file__).resolve().parents[2] / "configs" / "lab" / "quick.yaml"
SMALL = ["task.eval_size=8", "warmstart.steps=10"]
NAMES = ["loss=grpo,N=1,seed=0", "loss=grpo,N=4,seed=0", "loss=vespo,N=1,seed=0", "loss=vespo,N=4,seed=0"]


@pytest.fixture(scope="module")
def quick_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    out = root / "quick"
    argv = [str(QUICK), "--out", str(out), "--jobs", "2", f"warmstart.cache_dir={root / 'ws'}", *SMALL]
    assert sweep_cli.main(argv) == 0
    return out, argv


def test_every_grid_point_is_a_finished_run_on_the_papers_protocol(quick_sweep):
    out, _ = quick_sweep
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == NAMES
    for name in NAMES:
        run = out / name
        summary = json.loads((run / "summary.json").read_text())
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        n = int(name.split(",")[1].split("=")[1])
        assert summary["status"] == "done" and cfg["staleness"]["n"] == n and cfg["run"]["threads"] == 1
        # a fixed mini-batch of 2 prompts; the rollout batch is N x that; 4 optimizer steps at every N
        assert cfg["rollout"]["prompts_per_step"] == 2 * n and summary["steps_done"] == 4 // n
        assert summary["policy_version"] == 4
        assert json.loads((run / "lab.json").read_text())["returncode"] == 0
    rows = [json.loads(line) for line in (out / "loss=vespo,N=4,seed=0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness/lag_max"] for r in rows] == [3.0]  # mini-batches 0..3 of the one rollout batch


def test_one_seed_starts_every_condition_from_the_same_weights(quick_sweep):
    out, _ = quick_sweep
    before = [json.loads((out / name / "eval_before.json").read_text()) for name in NAMES]
    assert all(b == before[0] for b in before) and before[0]
    logs = [(out / name / "train.log").read_text() for name in NAMES]
    assert sum("supervised steps" in log for log in logs) == 1  # one warm start, the others load it
    assert sum("loaded cached weights" in log for log in logs) == 3


def test_the_session_is_recorded(quick_sweep):
    out, _ = quick_sweep
    (s,) = [json.loads(line) for line in (out / "sessions.jsonl").read_text().splitlines()]
    assert s["command"].startswith("vespo sweep ") and s["command"].endswith(" ".join(SMALL))
    assert s["seconds"] > 0 and s["start"] < s["end"] and s["runs"] == 4 and s["failed"] == 0
    assert s["interrupted"] is False and s["machine"]["cpus"] >= 1
    assert s["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", s["commit"])


def test_a_second_call_skips_the_finished_runs(quick_sweep, capsys):
    out, argv = quick_sweep
    spec = load_sweep(QUICK)
    spec.overrides += argv[5:]  # the cache dir and SMALL, as given on the command line
    assert {j.action for j in plan.plan(spec, out)} == {"skip"}
    before = (out / "loss=grpo,N=1,seed=0" / "metrics.jsonl").read_text()
    assert sweep_cli.main(argv) == 0
    assert "4 skip" in capsys.readouterr().out
    assert (out / "loss=grpo,N=1,seed=0" / "metrics.jsonl").read_text() == before


def test_report_and_page_from_the_real_runs(quick_sweep, tmp_path):
    out, _ = quick_sweep
    assert report_cli.main([str(out), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert re.search(r"\| grpo +\| 1 +\| 1 +\|", md) and "Paired differences against loss = vespo" in md
    assert (tmp_path / "rep" / "headline.png").read_bytes()[:4] == b"\x89PNG"
    # the archive beside the report holds every metric the report reads of these real runs
    assert report_cli.main([str(tmp_path / "rep" / "runs.json.gz"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").read_text() == md
    claims = tmp_path / "claims.yaml"
    claims.write_text(yaml.safe_dump({"claims": [
        {"paper": "VESPO above GRPO at N = 4", "sweep": "quick", "expect": "report",
         "compare": {"a": {"loss": "vespo", "N": "4"}, "b": {"loss": "grpo", "N": "4"}}}]}))
    page = tmp_path / "docs" / "results.md"
    assert report_cli.main([str(out), "--claims", str(claims), "--page", str(page)]) == 0
    text = page.read_text()
    assert re.search(r"\| 1 +\| VESPO above GRPO at N = 4 +\| quick +\| 4 +\| eval_sampled difference: vs loss=grpo: ", text)
    assert "(one seed)" in text and "Single runs are not results" in text
    assert "vespo sweep " in text and "4 / 4" in text
    links = [x for x in re.findall(r"\]\(([^)]+\.(?:png|md))\)", text) if x != "lab.md"]  # lab.md: docs/ only
    assert "results/quick/headline.png" in links
    for link in links:  # every figure and report link resolves
        assert (page.parent / link).is_file(), link


def test_a_changed_base_config_is_refused(quick_sweep, tmp_path):
    out, _ = quick_sweep
    changed = yaml.safe_load(QUICK.read_text())
    changed["base"]["optim"]["lr"] = 5e-4
    other = tmp_path / "quick.yaml"
    other.write_text(yaml.safe_dump(changed))
    with pytest.raises(SweepError, match="base.yaml differs"):
        plan.plan(load_sweep(other), out)


def test_dry_run_prints_the_protocol_and_the_commands_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "dry"
    assert sweep_cli.main([str(QUICK), "--out", str(out), "--dry-run", "--only", "N=4"]) == 0
    printed = capsys.readouterr().out
    assert "2 runs (2 start)" in printed
    assert "expected wall time for the 2 pending runs: 0 min (the sweep file assumes 8 s per run with 2" in printed
    assert "at your --jobs" not in printed  # the file's own count
    header = next(line for line in printed.splitlines() if line.strip().startswith("action"))
    assert header.split() == ["action", "run", "N", "mini-batch", "rollout", "batch", "rollout", "steps", "optimizer",
                              "steps", "samples"]
    row = next(line for line in printed.splitlines() if "loss=vespo,N=4,seed=0" in line and "start" in line)
    # N = 4: mini-batch 2 prompts x 4 responses, rollout batch 4 x 2 = 8 prompts, 1 rollout step of 4 updates
    assert row.split()[2:] == ["4", "2", "prompts", "x", "4", "=", "8", "8", "prompts", "=", "32", "1", "4", "32"]
    assert printed.count("-m vespo.cli train") == 2 and "run.threads=1" in printed
    assert not [p for p in out.iterdir() if p.is_dir()] and not (out / "sessions.jsonl").exists()


def test_the_expected_wall_time_at_another_jobs_count(tmp_path, capsys):
    """The file's estimate is at its own count side by side; --jobs 1 is said with its own figure (runs one after
    another), not left to the reader."""
    path = QUICK.parent / "real_stability.yaml"
    sweep = load_sweep(path)  # 2100 s per run, 2 at a time
    assert sweep_cli.main([str(path), "--out", str(tmp_path / "s"), "--dry-run", "--only", "seed=0", "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert (sweep.cost.run_s, sweep.cost.jobs) == (2100, 2)
    assert "expected wall time for the 4 pending runs: 70 min (the sweep file assumes 2100 s per run with 2 at a " \
           "time; at your --jobs 1, 140 min;" in printed


def test_only_rejects_values_outside_the_grid(tmp_path, capsys):
    assert sweep_cli.main([str(QUICK), "--out", str(tmp_path / "x"), "--dry-run", "--only", "N=64"]) == 2
    assert "N=['64'] is not on the grid" in capsys.readouterr().err


def test_a_failing_run_is_recorded_and_kept_as_failed(tmp_path):
    spec = yaml.safe_load(QUICK.read_text())
    spec["grid"] = {"run.seed": [0]}
    spec["overrides"] = ["staleness.n=1", "model.path=/nonexistent/model"]  # fails while loading the policy
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "bad"
    assert sweep_cli.main([str(path), "--out", str(out), "--jobs", "1"]) == 1
    lab = json.loads((out / "seed=0" / "lab.json").read_text())
    assert lab["status"] == "failed" and lab["returncode"] != 0
    assert [j.action for j in plan.plan(load_sweep(path), out)] == ["failed"]
    assert [j.action for j in plan.plan(load_sweep(path), out, retry_failed=True)] == ["start"]
    (s,) = [json.loads(line) for line in (out / "sessions.jsonl").read_text().splitlines()]
    assert s["failed"] == 1


def test_a_killed_call_still_leaves_its_session_line(tmp_path):
    """A call killed outright (SIGKILL, a machine restart) keeps its start, the last time it was seen
    alive and the seconds up to then; the page counts it as killed. A later call appends its own line."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import pandas as pd

    from vespo.lab.report import wall_text

    code = ("import sys, time; from pathlib import Path; from vespo.sweep.provenance import session\n"
            "with session(Path(sys.argv[1]), 'vespo sweep killed', 1, beat_s=0.05):\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    path = tmp_path / "sessions.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (path.is_file() and "last_seen" in path.read_text()):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with provenance.session(tmp_path, "vespo sweep resumed", 1):
        pass
    killed, resumed = [json.loads(line) for line in path.read_text().splitlines()]
    assert killed["command"] == "vespo sweep killed" and killed["end"] is None and killed["interrupted"] is None
    assert killed["seconds"] > 0 and killed["start"] <= killed["last_seen"]
    assert resumed["command"] == "vespo sweep resumed" and resumed["end"] and resumed["interrupted"] is False
    no_runs = pd.DataFrame({"record": []})
    assert "2 calls, 1 killed (counted to the last time seen alive)" in wall_text([killed, resumed], no_runs)


def test_sweep_calls_running_at_once_keep_each_ones_line(tmp_path):
    """Two `vespo sweep` calls on one directory at once (each on its own points): their heartbeats rewrite
    sessions.jsonl many times over, and each call's line stays whole (a call that assumed its line was the file's
    last garbled the other's)."""
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; from vespo.sweep.provenance import session\n"
            "with session(Path(sys.argv[1]), sys.argv[2], 1, beat_s=0.002):\n    time.sleep(1.5)\n")
    calls = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), f"vespo sweep --only seed={i}"])
             for i in range(2)]
    assert [call.wait() for call in calls] == [0, 0]
    lines = [json.loads(line) for line in (tmp_path / "sessions.jsonl").read_text().splitlines()]
    assert sorted(line["command"] for line in lines) == ["vespo sweep --only seed=0", "vespo sweep --only seed=1"]
    assert all(line["end"] and line["interrupted"] is False and line["seconds"] >= 1.5 for line in lines)


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path):
    """A run killed in its first seconds leaves metrics.jsonl (empty) and no checkpoint; the next call
    must run it again (with --resume, which starts over when there is no checkpoint) rather than
    start it plain, which `vespo train` refuses on a directory that already holds a run."""
    spec = yaml.safe_load(QUICK.read_text())
    spec["grid"] = {"run.seed": [0]}
    spec["overrides"] = ["staleness.n=1"]
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "one"
    argv = [str(path), "--out", str(out), "--jobs", "1", f"warmstart.cache_dir={tmp_path / 'ws'}", *SMALL]

    def planned():
        loaded = load_sweep(path)
        loaded.overrides += argv[5:]
        return plan.plan(loaded, out)

    (job,) = planned()
    assert job.action == "start"
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "metrics.jsonl").write_text("")  # what the killed process had written
    assert [j.action for j in planned()] == ["resume"]
    assert sweep_cli.main(argv) == 0
    assert json.loads((job.run_dir / "summary.json").read_text())["status"] == "done"
    steps = [json.loads(line)["step"] for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps and steps == sorted(set(steps))  # one run's rows, once each
    assert [p.name for p in (job.run_dir / "restarted").glob("*/*")] == ["metrics.jsonl"]  # moved, not deleted


@pytest.mark.slow  # ~2-3 min on a 2-core CI machine (a Ray cluster and two real runs); planning, resuming and the
# records it shares with the local sweep are in the default run
def test_a_sweep_on_ray_runs_its_runs_as_tasks_side_by_side_and_resumes(tmp_path):
    """--ray-address local: the runs are Ray tasks (two at a time here, as on a cluster), the records are the
    local sweep's, and a second call skips the finished runs."""
    out = tmp_path / "ray"
    argv = [str(QUICK), "--out", str(out), "--jobs", "2", "--ray-address", "local", "--only", "loss=vespo",
            f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=0", *SMALL[:1]]
    assert sweep_cli.main(argv) == 0
    labs = [json.loads((out / name / "lab.json").read_text()) for name in NAMES[2:]]
    assert all(lab["status"] == "finished" and lab["returncode"] == 0 for lab in labs)
    first, second = sorted(labs, key=lambda lab: lab["started"])
    assert second["started"] < first["ended"]  # the two runs overlapped
    assert all(json.loads((out / name / "summary.json").read_text())["status"] == "done" for name in NAMES[2:])
    assert sweep_cli.main(argv) == 0  # resumes: both skipped
    assert all(json.loads((out / name / "lab.json").read_text())["started"] == lab["started"]
               for name, lab in zip(NAMES[2:], labs))


def test_report_skips_plain_files_a_glob_matched(quick_sweep, tmp_path, capsys):
    out, _ = quick_sweep
    log = out.parent / "driver.log"
    log.write_text("a sweep driver's log beside the sweep directories\n")
    assert report_cli.main([str(out), str(log), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.md").is_file()
    assert "skipping 1 file(s) that are not sweep directories" in capsys.readouterr().err


def test_a_run_stopped_by_ctrl_c_is_interrupted_and_resumed_not_failed(tmp_path):
    """`vespo train` exits 130 after Ctrl-C with its checkpoint written: the sweep records the run as
    interrupted (not failed, not counted as a failure) and its next call resumes it."""
    import subprocess
    import sys

    from vespo.sweep.launch import run_all

    spec = yaml.safe_load(QUICK.read_text())
    spec["grid"], spec["overrides"] = {"run.seed": [0]}, ["staleness.n=1"]
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "one"
    (job,) = plan.plan(load_sweep(path), out)

    def stopped_by_ctrl_c(args, log):  # a child that ends as `vespo train` does after SIGINT, having checkpointed
        (job.run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(130)"])

    assert run_all([job], out, 1, stopped_by_ctrl_c) == 0
    lab = json.loads((job.run_dir / "lab.json").read_text())
    assert (lab["status"], lab["returncode"]) == ("interrupted", 130)
    assert [j.action for j in plan.plan(load_sweep(path), out)] == ["resume"]


@pytest.mark.parametrize("how", ["sigterm_to_the_sweep", "ctrl_c_to_the_group"])
def test_a_stopped_sweep_starts_no_further_run_and_the_same_command_resumes(tmp_path, how):
    """SIGTERM to `vespo sweep` alone (what `kill` or a scheduler sends) is passed on to its running run; Ctrl-C
    reaches every process of the group. Either way the run finishes its step, checkpoints and exits 130
    (interrupted, not failed), no further run starts, the sweep exits 130, and the same command resumes the one
    and starts the others. (Before: SIGTERM killed the sweep and left its run going; after Ctrl-C the sweep went
    on to start every pending run.)"""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "q"
    argv = [str(QUICK), "--out", str(out), "--jobs", "1", "--only", "seed=0", f"warmstart.cache_dir={tmp_path / 'ws'}",
            *SMALL, "run.updates=400"]
    proc = subprocess.Popen([sys.executable, "-m", "vespo.cli", "sweep", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    first, metrics = NAMES[0], out / NAMES[0] / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    if how == "sigterm_to_the_sweep":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, output
    lab = json.loads((out / first / "lab.json").read_text())
    assert (lab["status"], lab["returncode"]) == ("interrupted", 130), output
    assert json.loads((out / first / "summary.json").read_text())["status"] == "interrupted"
    assert any((out / first / "checkpoints").glob("step-*"))
    for name in NAMES[1:]:
        assert not (out / name).exists(), output  # never started
        assert f"left    {name} (the sweep was stopped" in output
    stopped = "SIGTERM" if how == "sigterm_to_the_sweep" else "SIGINT"
    assert f"vespo sweep: stopping ({stopped})" in output and f"vespo sweep: stopped ({stopped})" in output
    assert json.loads((out / "sessions.jsonl").read_text().splitlines()[-1])["stopped"] == stopped
    sweep = load_sweep(QUICK)
    sweep.overrides += argv[7:]
    assert [j.action for j in plan.plan(sweep, out)] == ["resume", "start", "start", "start"]


def test_a_run_the_nonfinite_guard_stopped_is_told_by_its_summary_not_its_log(tmp_path):
    """lab.json's stopped_nonfinite comes from the summary this start of the run wrote (the log may say anything);
    a summary an earlier start left does not count."""
    import subprocess
    import sys

    from vespo.sweep.launch import run_all

    spec = yaml.safe_load(QUICK.read_text())
    spec["grid"], spec["overrides"] = {"run.seed": [0]}, ["staleness.n=1"]
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(spec))
    (job,) = plan.plan(load_sweep(path), tmp_path / "one")

    def failing(summary):
        def start(args, log):  # a child that fails, having written ``summary`` (or nothing)
            if summary is not None:
                (job.run_dir / "summary.json").write_text(json.dumps(summary))
            return subprocess.Popen([sys.executable, "-c", "print('no traceback here'); raise SystemExit(1)"],
                                    stdout=open(log, "a"))
        return start

    def stopped_nonfinite() -> bool:
        return json.loads((job.run_dir / "lab.json").read_text())["stopped_nonfinite"]

    assert run_all([job], tmp_path / "one", 1, failing({"status": "non_finite"})) == 1
    assert stopped_nonfinite() is True
    assert run_all([job], tmp_path / "one", 1, failing(None)) == 1  # the old summary stays, not written by this start
    assert stopped_nonfinite() is False


def test_a_seed_whose_start_would_differ_from_its_finished_runs_is_warned(tmp_path, capsys):
    """A shared on-policy start is cached per machine: a seed's pending runs that would train from another start
    than the one its finished runs recorded (the cache's differs, or it is gone and is made again) are told at
    planning, and again once a remade start is there, since `vespo report` will not pair them."""
    spec = yaml.safe_load(QUICK.read_text())
    spec["grid"] = {"loss": spec["grid"]["loss"], "run.seed": [0]}
    spec["base"]["warmstart"] = {"kind": "on_policy", "steps": 2}
    spec["overrides"] = ["staleness.n=1"]
    path = tmp_path / "starts.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "starts"
    argv = [str(path), "--out", str(out), "--jobs", "1", f"warmstart.cache_dir={tmp_path / 'ws'}", *SMALL[:1]]

    def planned():
        loaded = load_sweep(path)
        loaded.overrides += argv[5:]
        return plan.plan(loaded, out)

    grpo, vespo = planned()
    assert grpo.warm_key == vespo.warm_key and grpo.warm_key.endswith("start.json")
    assert plan.start_warnings([grpo, vespo]) == []  # nothing finished: nothing to agree with
    vespo.run_dir.mkdir(parents=True)  # vespo finished on a start made elsewhere: 24 updates to 0.207
    (vespo.run_dir / "summary.json").write_text(json.dumps({"status": "done", "warmstart": {
        "warmstart/updates": 24.0, "warmstart/sampled_accuracy": 0.207, "warmstart/target_reached": 1.0}}))
    (vespo.run_dir / "lab.json").write_text(json.dumps({"overrides": vespo.point.overrides, "returncode": 0}))
    jobs = planned()
    assert [j.action for j in jobs] == ["start", "skip"]
    (line,) = plan.start_warnings(jobs)
    assert line.startswith("the shared start of loss=grpo,seed=0 is not in the cache") and \
        "finished runs of it (loss=vespo,seed=0) trained from 24 updates, 0.207" in line
    key = Path(grpo.warm_key)
    key.parent.mkdir(parents=True)
    for updates, accuracy, warned in ((24, 0.207, False), (48, 0.137, True)):
        key.write_text(json.dumps({"updates": updates, "eval": {"reward_sampled": accuracy}, "target_reached": True}))
        lines = plan.start_warnings(jobs)
        assert bool(lines) == warned
    assert lines[0].startswith("loss=grpo,seed=0 would train from the cached shared start (48 updates, 0.137), but")
    key.unlink()
    # a real call: warned at planning, then the remade start (2 updates of the nano model, not 24) told apart
    assert sweep_cli.main(argv) == 0
    said = capsys.readouterr().out
    assert "warning: the shared start of loss=grpo,seed=0 is not in the cache" in said
    made = json.loads(key.read_text())
    assert made["updates"] == 2 and "  warning: loss=grpo,seed=0 would train from the cached shared start (2 updates" \
        in said
