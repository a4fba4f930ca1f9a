"""avg@k / pass@k on hand-made results, `evaluate` with a scripted generate_fn, and `vespo eval`
end to end on a tiny saved policy."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from math import comb

import pytest

from vespo.eval_cli import main, parse_assignments
from vespo.evaluation import avg_at_k, evaluate, pass_at_k
from vespo.rewards import RewardScorer
from vespo.tasks import get_task
from vespo.types import Problem


def pass_at_k_reference(n, c, k):
    """Exact rational 1 - C(n-c, k) / C(n, k) (math.comb is 0 when n-c < k)."""
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def test_pass_at_k_by_hand():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-15)
    # n=5, c=2, k=1: 1 - C(3,1)/C(5,1) = 1 - 3/5 = 0.4 (pass@1 = c/n)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12, abs=1e-15)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(3, 2, 2) == 1.0


def test_pass_at_k_matches_exact_reference_everywhere_small():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(pass_at_k_reference(n, c, k)), abs=1e-12)


@pytest.mark.parametrize("args", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4), (3.0, 1, 1)])
def test_pass_at_k_rejects_impossible_counts(args):
    with pytest.raises(ValueError, match="n, c and k|0 <= c <= n"):
        pass_at_k(*args)


def test_avg_at_k_by_hand():
    # problem means: (1+0+1+1)/4 = 0.75, (0+0)/2 = 0, (0.5)/1 = 0.5 -> (0.75 + 0 + 0.5) / 3 = 5/12
    assert avg_at_k([[1, 0, 1, 1], [0, 0], [0.5]]) == pytest.approx(5 / 12, abs=1e-15)
    with pytest.raises(ValueError, match="problem 1 has no samples"):
        avg_at_k([[1.0], []])
    with pytest.raises(ValueError, match="problem 0 has a non-finite reward"):
        avg_at_k([[math.nan]])
    with pytest.raises(ValueError, match="at least one problem"):
        avg_at_k([])


def scripted_generate(correct_first):
    """generate_fn whose problem with prompt "q<i>" gets correct_first[i] right answers ("a<i>") then wrong ones."""
    calls = []

    def generate(problems, n):
        calls.append(([p.prompt for p in problems], n))
        out = []
        for problem in problems:
            i = int(problem.prompt[1:])
            out.append([f"a{i}" if j < correct_first[i] else "wrong" for j in range(n)])
        return out

    return generate, calls


def exact(completion, truth):
    return 1.0 if completion == truth else 0.0


def make_problems(sources):
    return [Problem(id=f"p{i}", prompt=f"q{i}", ground_truth=f"a{i}", data_source=s) for i, s in enumerate(sources)]


def test_evaluate_per_source_k_by_hand():
    problems = make_problems(["aime", "aime", "math", "math", "other"])
    generate, calls = scripted_generate([1, 4, 0, 2, 3])
    report = evaluate(generate, problems, exact, k_by_source={"aime": 4, "math": 2}, default_k=3)
    assert sorted((tuple(p), n) for p, n in calls) == [(("q0", "q1"), 4), (("q2", "q3"), 2), (("q4",), 3)]
    aime, math_, other = report.sources["aime"], report.sources["math"], report.sources["other"]
    # aime, k=4: correct 1 and 4 -> avg = (1/4 + 4/4)/2 = 0.625; pass@4 = (1 + 1)/2 = 1.0
    assert (aime.k, aime.num_problems, aime.avg_at_k, aime.pass_at_k) == (4, 2, 0.625, 1.0)
    assert aime.pass_at_1 == pytest.approx(0.625)
    # math, k=2: correct 0 and 2 -> avg = (0 + 1)/2 = 0.5; pass@2 = (0 + 1)/2 = 0.5
    assert (math_.k, math_.avg_at_k, math_.pass_at_k) == (2, 0.5, 0.5)
    # other, default k=3: 3 of 3 correct
    assert (other.k, other.avg_at_k, other.pass_at_k, other.num_errors) == (3, 1.0, 1.0, 0)
    assert [r.problem_id for r in report.results] == ["p0", "p1", "p2", "p3", "p4"]  # input order kept
    assert report.results[1].rewards == [1.0] * 4 and report.results[0].num_correct == 1


def flaky(completion, truth):
    if completion == "wrong":
        raise RuntimeError("cannot score")
    return 1.0 if completion == truth else 0.0


def test_evaluate_counts_reward_errors_as_incorrect():
    problems = make_problems(["s", "s"])
    generate, _ = scripted_generate([1, 2])
    report = evaluate(generate, problems, flaky, default_k=2)
    # p0: [1, error -> 0], p1: [1, 1] -> avg = (0.5 + 1)/2 = 0.75, one error
    assert report.sources["s"].avg_at_k == 0.75 and report.sources["s"].num_errors == 1
    assert report.results[0].rewards == [1.0, 0.0] and report.results[0].num_errors == 1


def test_evaluate_checks_its_inputs():
    problems = make_problems(["s"])
    with pytest.raises(ValueError, match="k for 's' must be an integer >= 1, got 0"):
        evaluate(scripted_generate([1])[0], problems, exact, k_by_source={"s": 0})
    with pytest.raises(ValueError, match="must return 2 completions for each of 1 problems"):
        evaluate(lambda problems, n: [["a0"]], problems, exact, default_k=2)
    with pytest.raises(ValueError, match="at least one problem"):
        evaluate(scripted_generate([])[0], [], exact)


def test_evaluate_with_a_task_and_reference_completions():
    task = get_task("rg:countdown")  # a reasoning-gym verifier reading its ground truth's metadata
    problems = task.generate(6, seed=0)
    report = evaluate(lambda ps, n: [[task.reference_completion(p)] * n for p in ps], problems,
                      RewardScorer(task.reward, num_workers=0), default_k=2)
    assert report.sources["rg:countdown"].avg_at_k == 1.0 and report.sources["rg:countdown"].pass_at_k == 1.0


def test_parse_assignments():
    assert parse_assignments(["aime=32", "amc=16"], "--k", int) == {"aime": 32, "amc": 16}
    with pytest.raises(ValueError, match="--k expects KEY=VALUE, got 'aime'"):
        parse_assignments(["aime"], "--k", int)
    with pytest.raises(ValueError, match="--k 'aime=x'"):
        parse_assignments(["aime=x"], "--k", int)


@pytest.fixture(scope="module")
def tiny_policy_dir(tmp_path_factory):
    from vespo.models import build_char_tokenizer, save_policy, tiny_model

    tokenizer = build_char_tokenizer()
    path = tmp_path_factory.mktemp("policy")
    save_policy(tiny_model(tokenizer=tokenizer, seed=0), tokenizer, path)
    return path


def test_vespo_eval_on_a_task_writes_jsonl(tiny_policy_dir, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    code = main(["--model", str(tiny_policy_dir), "--task", "addition", "--task-arg", "digits=1",
                 "--n-problems", "3", "--default-k", "2", "--batch-size", "4", "--out", str(out)])
    assert code == 0
    said = capsys.readouterr()
    assert "addition" in said.out
    # progress on stderr: 3 problems x 2 samples in batches of 4
    assert [line for line in said.err.splitlines() if line.startswith("vespo eval: ")] == [
        "vespo eval: 4/6 completions", "vespo eval: 6/6 completions"]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["type"] for line in lines] == ["source", "problem", "problem", "problem"]
    assert lines[0]["k"] == 2 and lines[0]["num_problems"] == 3 and 0.0 <= lines[0]["avg_at_k"] <= 1.0
    for line in lines[1:]:
        assert len(line["completions"]) == 2 and all(len(c) <= 3 for c in line["completions"])  # 1 digit + 1 + eos


def test_vespo_eval_on_a_data_file_with_math_reward(tiny_policy_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": "1+1="}],
             "reward_model": {"ground_truth": "2"}}, {"prompt": "2+2=", "answer": "4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.jsonl"
    code = main(["--model", str(tiny_policy_dir), "--data", str(data), "--k", "toy=3", "--default-k", "1",
                 "--max-new-tokens", "4", "--num-workers", "0", "--out", str(out)])
    assert code == 0
    sources = {line["data_source"]: line for line in map(json.loads, out.read_text().splitlines())
               if line["type"] == "source"}
    assert sources["toy"]["k"] == 3 and sources["d"]["k"] == 1
