"""The asynchronous trainer on a real local Ray with real rollout actors: admission control and lag
statistics worked by hand, then short runs on the nano Qwen3 policy (1-digit addition) in which
reward rises, the staleness bound holds row by row, a SIGKILLed worker is survived, Ctrl-C + resume
continues the run, and a failing worker stops everything with a checkpoint and no Ray processes left.

Starting Ray costs ~20 s on a loaded 2-core machine, so the runs share one module-scoped Ray; the
first test starts (and must shut down) its own.
"""

import json
import os
import signal
import time

import psutil
import pytest
import ray
import torch

from vespo.buffer import StalenessBound, TicketQueue, lag_stats
from vespo.metrics import read_jsonl
from vespo.trainer import train
from vespo.trainer.checkpoint import latest_checkpoint
from vespo.trainer.ray_source import WorkerError


# ---------------------------------------------------------------- pure parts, by hand


def test_admission_rule_by_hand():
    bound = StalenessBound(2)
    # weights w = 4, nothing skipped: ticket t may start iff t - 4 <= 2, so tickets <= 6
    assert [bound.admits(t, 4) for t in (4, 5, 6, 7)] == [True, True, True, False]
    # 1 skipped update: ticket 7 is trained at learner version <= 6, so it may start with w = 4
    assert bound.admits(7, 4, skipped=1) and not bound.admits(8, 4, skipped=1)
    assert bound.needed_version(7) == 5 and bound.needed_version(7, skipped=1) == 4
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        StalenessBound(-1)


def test_ticket_queue_delivers_in_order():
    q = TicketQueue(first_ticket=3)
    q.put(4, "b")
    assert not q.ready() and q.depth == 1
    with pytest.raises(KeyError, match="ticket 3 has not arrived"):
        q.pop()
    q.put(3, "a")
    assert q.pop() == (3, "a") and q.pop() == (4, "b") and q.depth == 0
    with pytest.raises(ValueError, match="ticket 4 was already delivered"):
        q.put(4, "again")


def test_lag_stats_by_hand():
    # lags 0, 1, 1, 3 with bound 3: hist = [1/4, 2/4, 0, 1/4]; mean 5/4; median (1 + 1)/2 = 1
    # spans 0, 2, 0, 1: mean 3/4, max 2, partial rows 2 of 4
    out = lag_stats(torch.tensor([0, 1, 1, 3]), torch.tensor([0, 2, 0, 1]), max_staleness=3)
    assert [out[f"staleness/lag_hist_{j}"] for j in range(4)] == [0.25, 0.5, 0.0, 0.25]
    assert out["staleness/lag_mean"] == 1.25 and out["staleness/lag_p50"] == 1.0 and out["staleness/lag_max"] == 3.0
    assert out["staleness/span_mean"] == 0.75 and out["staleness/span_max"] == 2.0
    assert out["staleness/partial_frac"] == 0.5
    with pytest.raises(ValueError, match="lags is empty"):
        lag_stats(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 3)


# ---------------------------------------------------------------- real runs


def _async(make_cfg, *overrides, out="run"):
    # a wedged Ray turns into a WorkerError (a test failure) instead of a hang
    return make_cfg("run.mode=async", "async.chunk_tokens=1", "async.stall_timeout_s=600", *overrides, out=out)


def _ray_processes() -> list[tuple[psutil.Process, str]]:
    """This test process's descendants: with a local Ray, gcs_server, raylet and every worker."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append((p, p.name()))
        except psutil.NoSuchProcess:
            pass
    return out


def _still_running(procs: list[tuple[psutil.Process, str]], timeout_s: float = 20.0) -> list[str]:
    """The processes of ``procs`` alive after up to ``timeout_s`` (a recycled pid does not count)."""

    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    left = procs
    while left and time.monotonic() < deadline:
        left = [(p, name) for p, name in left if alive(p)]
        time.sleep(0.2)
    return [f"{p.pid} {name}" for p, name in left]


def test_failing_worker_stops_the_run_with_a_checkpoint_and_no_ray_processes(make_cfg):
    if ray.is_initialized():  # this test owns its Ray: train_async starts it and must stop it
        ray.shutdown()
    cfg = _async(make_cfg, "run.steps=4", "async.workers=1")
    seen: dict = {}
    # children that existed before (e.g. multiprocessing's resource tracker from earlier tests) are not Ray's
    before = {p.pid for p, _ in _ray_processes()}

    def break_the_worker(loop):
        if loop.updates_done == 2:
            source = loop.source
            seen["procs"] = [(p, name) for p, name in _ray_processes() if p.pid not in before]
            seen["worker_pid"] = ray.get(source.workers[0].pid.remote())
            ray.get(source.workers[0].__ray_call__.remote(install_failing_reward))

    def install_failing_reward(worker):  # runs inside the worker actor (pickled by value)
        def reward_fn(completions, truths):
            raise RuntimeError("reward service down")

        worker.rollout_scorer.reward_fn = reward_fn

    with pytest.raises(WorkerError, match="rollout worker 0 failed on ticket"):
        train(cfg, on_update=break_the_worker)
    # the Ray source can checkpoint after any update: the failure leaves one at the update it stopped at
    state = torch.load(latest_checkpoint(cfg.run.out_dir) / "trainer.pt", weights_only=True)
    assert 2 <= state["updates"] < 8 and state["learner"]["version"] == state["updates"]
    assert state["source"]["tickets"] == state["updates"]
    assert not ray.is_initialized()
    names = {name for _, name in seen["procs"]}
    assert seen["worker_pid"] in {p.pid for p, _ in seen["procs"]} and {"raylet", "gcs_server"} <= names, names
    assert _still_running(seen["procs"]) == []


@pytest.fixture(scope="module")
def local_ray():
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=4)  # a worker + 2 learner actors
    yield
    ray.shutdown()


@pytest.mark.slow  # ~3 min idle on a 2-core CI machine (60 rollout steps after a 60-step warm start); the quick async
# tests below keep the learner actor, Ctrl-C/resume and worker failures in the default run
def test_async_run_with_a_two_rank_learner_learns_survives_a_killed_worker_and_keeps_the_bound(make_cfg, local_ray):
    # the sync learning setup (tests/trainer/test_learning.py), K = 4, bound 4, partial rollouts; the learner is
    # two Ray actors in one process group (FSDP2), each training half of every mini-batch
    cfg = _async(make_cfg, "rollout.prompts_per_step=16", "rollout.group_size=8", "staleness.n=2",
                 "task.eval_size=64", "warmstart.steps=60", "warmstart.lr=3e-3", "optim.lr=3e-4", "run.steps=60",
                 "async.sync_every=4", "async.max_staleness=4", "async.learner=actor", "async.learner_workers=2")
    killed: dict = {}

    def kill_worker_once(loop):
        if "learners" not in killed:
            killed["learners"] = ray.get([a.__ray_call__.remote(lambda actor: os.getpid()) for a in loop.learner.actors])
        if loop.updates_done == 20 and "pid" not in killed:
            killed["pid"] = ray.get(loop.source.workers[0].pid.remote())
            os.kill(killed["pid"], signal.SIGKILL)

    summary = train(cfg, on_update=kill_worker_once)
    assert summary["status"] == "done" and summary["worker_restarts"] == 1 and summary["updates_done"] == 120
    assert len(set(killed["learners"])) == 2 and os.getpid() not in killed["learners"]

    records = read_jsonl(f"{cfg.run.out_dir}/versions.jsonl")
    assert [r["ticket"] for r in records] == list(range(120))
    lags = [r["learner_version"] - v for r in records for v in r["versions"]]
    spans = [hi - lo for r in records for lo, hi in zip(r["versions"], r["versions_max"])]
    assert max(lags) <= 4, max(lags)  # the bound, row by row
    assert max(lags) >= 1  # really asynchronous
    # responses spanning versions depend on timing here; tests/rollout checks reload mid-generation exactly
    assert min(spans) >= 0

    rows = read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 61)) and rows[0]["dist/world_size"] == 2.0
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:15]) / 15, sum(rewards[-15:]) / 15
    after, before = summary["eval_after"], summary["eval_before"]
    print(f"LEARNING first={first:.4f} last={last:.4f} heldout_before={before['reward_greedy'] + before['reward_sampled']:.4f}"
          f" heldout_after={after['reward_greedy'] + after['reward_sampled']:.4f}")  # read by bench/flakes.py
    # Async timing decides which weights sample which token, so the numbers depend on the machine's load.
    # Measured (python bench/flakes.py --tests async --repeats 8, with a 2-job lab sweep loading both cores):
    # 8/8 passed, training reward 0.305 (first 15 steps) -> 0.380 (last 15) in every run; the mean of 15
    # steps x 128 samples has a sampling error of about 0.011, so the 0.04 margin sits 3 errors below the
    # measured rise. Held-out reward on 64 problems (sampling error ~0.06 per figure) is logged, not asserted:
    # it once fell on a busy machine while training reward rose.
    assert last > first + 0.04, (first, last, rewards)
    for key in ("staleness/lag_hist_0", "staleness/lag_p50", "staleness/span_mean", "perf/rollout_tokens_per_s",
                "perf/learner_idle_frac", "perf/queue_depth_max", "mismatch/k3", "is/ess", "loss/total"):
        assert key in rows[-1], key
    assert abs(sum(rows[-1][f"staleness/lag_hist_{j}"] for j in range(5)) - 1.0) < 1e-9


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C; kill or a scheduler (Ray's own
def test_ctrl_c_writes_a_checkpoint_and_resume_finishes_the_run(make_cfg, local_ray, signum):  # handler exits)
    cfg = _async(make_cfg, "run.steps=4", "staleness.n=2", "async.max_staleness=1", "async.sync_every=2",
                 out=f"run_{signum.name}")

    def ctrl_c(loop):
        if loop.updates_done == 3:
            os.kill(os.getpid(), signum)

    first = train(cfg, on_update=ctrl_c)
    assert first["status"] == "interrupted" and first["updates_done"] == 4  # the rollout step is finished
    summary = train(cfg, resume=True)
    assert summary["status"] == "done" and summary["updates_done"] == 8 and summary["policy_version"] == 8
    records = read_jsonl(f"{cfg.run.out_dir}/versions.jsonl")
    assert [r["ticket"] for r in records] == list(range(8))
    assert max(r["learner_version"] - v for r in records for v in r["versions"]) <= 1
    assert [r["step"] for r in read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl")] == [1, 2, 3, 4]
    state = torch.load(latest_checkpoint(cfg.run.out_dir) / "trainer.pt", weights_only=True)
    assert state["source"]["stream"]["cursor"] == 8 * cfg.prompts_per_minibatch  # each prompt drawn once, none lost
    assert json.loads(open(f"{cfg.run.out_dir}/summary.json").read())["mode"] == "async"


def test_learner_as_its_own_ray_actor(make_cfg, local_ray):
    """async.learner=actor: the optimizer lives in another process; the loop, pushes and checkpoints still work."""
    cfg = _async(make_cfg, "run.steps=3", "staleness.n=2", "async.learner=actor", "async.learner_num_cpus=1",
                 "async.sync_every=2", "async.max_staleness=2", "run.checkpoint_every=1")
    where: dict = {}

    def record(loop):
        if "learner_pid" not in where:
            where["learner_pid"] = ray.get(loop.learner.actors[0].__ray_call__.remote(lambda actor: os.getpid()))

    summary = train(cfg, on_update=record)
    assert summary["status"] == "done" and summary["updates_done"] == 6 and summary["policy_version"] == 6
    assert where["learner_pid"] != os.getpid()
    state = torch.load(latest_checkpoint(cfg.run.out_dir) / "trainer.pt", weights_only=True)
    assert state["updates"] == 6 and state["learner"]["version"] == 6  # written by the actor
    assert (cfg.run.out_dir and (latest_checkpoint(cfg.run.out_dir).parent.parent / "policy" / "config.json").is_file())
    rows = read_jsonl(f"{cfg.run.out_dir}/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["optim/n_skipped"] == 0.0 for r in rows)
    assert summary["weight_pushes"] >= 3  # the initial push and one every 2 updates, from the actor's store


def test_a_reward_error_in_a_worker_is_the_users_one_line_error(make_cfg, local_ray):
    """A user error raised inside a rollout worker (every reward of a batch failed) reaches the command as
    itself (one line, exit 2), not as a worker failure with a traceback."""
    from vespo.rewards import RewardsFailedError

    cfg = _async(make_cfg, "run.steps=2", "staleness.n=2", out="bad_reward")

    def break_rewards(loop):
        def fail(worker):
            def reward_fn(completions, problems):
                raise RewardsFailedError("every reward of a batch of 4 failed: user_rewards:f raised KeyError")

            worker.rollout_scorer.reward_fn = reward_fn

        ray.get([w.__ray_call__.remote(fail) for w in loop.source.workers])

    with pytest.raises(RewardsFailedError, match="every reward of a batch of 4 failed"):
        train(cfg, on_update=break_rewards)
