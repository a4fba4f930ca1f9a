"""How often the learning tests fail, run again and again, by default while other work loads the machine.

    python bench/flakes.py --repeats 10                       # every learning test, 10 fresh runs each
    python bench/flakes.py --repeats 20 --tests async         # one of them

Each repeat is a fresh `pytest` process running one test. A test that prints a line starting with
LEARNING (key=value pairs) has those values collected, so the margin of its assertion can be set
from their measured spread. Prints, per test: passes / repeats, the load average during the runs,
and for each collected value its mean, standard deviation, minimum and maximum. The output of a
failing run is appended to $FLAKES_LOG (default flakes_failures.log).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

FAILURES = os.environ.get("FLAKES_LOG", "flakes_failures.log")  # where a failing run's output is kept
TESTS = {
    "sync": "tests/trainer/test_learning.py::test_vespo_raises_reward_on_addition",
    "async": "tests/trainer/test_async.py::"
             "test_async_run_with_a_two_rank_learner_learns_survives_a_killed_worker_and_keeps_the_bound",
    "fsdp": "tests/distributed/test_fsdp.py::"
            "test_a_killed_rank_stops_the_job_and_the_run_resumes_learns_and_resumes_bit_for_bit",
    "ess_step": "tests/trainer/test_ess_step.py",
    "verl_reward": "tests/rewards/test_reward_signatures.py::test_vespo_train_with_a_verl_reward_file",
}


def run_once(node: str) -> tuple[bool, dict[str, float], float]:
    """(passed, LEARNING values, load average at the end) of one fresh pytest run of ``node``."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           "-m", "slow or not slow", node],  # the test whether or not it is marked slow
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:  # the failure's own words, for the record
        with open(FAILURES, "a") as f:
            f.write(f"==== {node} (exit {proc.returncode})\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}\n")
    values = {}
    for line in proc.stdout.splitlines():
        if line.startswith("LEARNING"):
            values.update({k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", line)})
    return proc.returncode == 0, values, os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tests", nargs="*", default=list(TESTS), choices=list(TESTS))
    args = p.parse_args()
    for name in args.tests:
        results = []
        t0 = time.time()
        for _ in range(args.repeats):
            results.append(run_once(TESTS[name]))
        passed = sum(ok for ok, _, _ in results)
        loads = [load for _, _, load in results]
        print(f"{name}: {passed}/{args.repeats} passed in {time.time() - t0:.0f} s; load average "
              f"{min(loads):.1f}-{max(loads):.1f}")
        keys = sorted({k for _, values, _ in results for k in values})
        for key in keys:
            xs = [values[key] for _, values, _ in results if key in values]
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            print(f"    {key:<16} mean {statistics.mean(xs):.4f}  sd {sd:.4f}  min {min(xs):.4f}  max {max(xs):.4f}")
        if keys == ["first", "heldout_after", "heldout_before", "last"]:
            rise = [v["last"] - v["first"] for _, v, _ in results if v]
            held = [v["heldout_after"] - v["heldout_before"] for _, v, _ in results if v]
            for label, xs in (("training rise", rise), ("held-out rise", held)):
                sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
                print(f"    {label:<16} mean {statistics.mean(xs):.4f}  sd {sd:.4f}  min {min(xs):.4f}")


if __name__ == "__main__":
    main()
