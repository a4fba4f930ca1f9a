"""The results page regenerated from the committed archives (docs/results/*/runs.json.gz) with the shipped
claims file: every table no rule of issue 35 changes is the table the page showed before
(tests/lab/data/results_before.md, the page at 86ecfca), and the page's conclusions follow the new rules
on the real runs: nothing picked at identical updates or among ties, the collapse rule checked against an
independent criterion, the end point measured."""

import fnmatch
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from vespo.lab import collapse
from vespo.lab.report import write_page
from vespo.lab.runs import read_lab
from vespo.lab.stats import ci_text, mean_ci

from markdown_table import cells

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = ["staleness", "async", "lr_range", "lr_range_async", "endpoint", "length_norm", "asymmetry", "mismatch",
          "mismatch_dense"]
BEFORE = Path(__file__).parent / "data" / "results_before.md"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs")
    for name in SWEEPS:  # a copy of the archives: the page writer rewrites its folders
        (docs / "archives" / name).mkdir(parents=True)
        shutil.copy(ROOT / "docs" / "results" / name / "runs.json.gz", docs / "archives" / name)
    path = docs / "results.md"  # the page without its figures (drawing them takes most of the time)
    write_page([docs / "archives" / n for n in SWEEPS], path, ROOT / "configs" / "lab" / "claims.yaml", None, "test",
               draw=False)
    return path.read_text()


def _sections(text):
    """{sweep: its section's tables (lists of rows of cells)} and the sweeps table."""
    out = {}
    for part in text.split("\n### `")[1:]:
        name = part.split("`")[0]
        blocks = re.findall(r"((?:^\|.*\n)+)", part, flags=re.M)
        out[name] = [cells(b) for b in blocks]
    sweeps = cells(re.findall(r"((?:^\|.*\n)+)", text.split("## Sweeps")[1], flags=re.M)[0])
    return out, sweeps


def _by_head(tables):
    return {tuple(t[0]): t for t in tables}


def test_the_tables_no_rule_changed_are_the_same(page):
    old, old_sweeps = _sections(BEFORE.read_text())
    new, new_sweeps = _sections(page)
    assert new_sweeps == old_sweeps
    changed_collapse = {("staleness", ("64", "sapo")), ("lr_range", ("2e-4", "grpo")), ("lr_range", ("1.25e-4", "m2po"))}
    for name in SWEEPS:
        before, after = _by_head(old[name]), _by_head(new[name])
        for head, table in before.items():
            if "stable lr range" in head:  # the lr range follows the collapse rule: compared below
                continue
            if "collapsed" in head:  # the condition table: every cell but the collapse counts the rule moved
                k, col = head.index("runs"), head.index("collapsed")  # the condition's labels come first
                old_rows = {tuple(r[:k]): r for r in table[1:]}
                assert len(after[head]) == len(table)
                for r in after[head][1:]:
                    o = old_rows[tuple(r[:k])]
                    assert r[:col] + r[col + 1:] == o[:col] + o[col + 1:], (name, r[:k])
                    moved = int(r[col].split("/")[0]) - int(o[col].split("/")[0])
                    assert moved == ((name, tuple(r[:k])) in changed_collapse), (name, r[:k], o[col], r[col])
            else:
                assert after[head] == table, (name, head)
    # the coverage table keeps its rows and gains the collapse mixture
    cover = lambda text: cells(text.split("**Intervals.**")[1].split("\n\n")[1])  # noqa: E731
    assert cover(page)[:4] == cover(BEFORE.read_text()) and cover(page)[4][0].startswith("some runs collapse")


def test_the_recommendation_picks_nothing_at_identical_updates_or_among_ties(page):
    head = page.split("## Recommendation")[1].split("Losses are compared")[0]
    lines = [x for x in head.splitlines() if x.startswith("- ")]
    n1 = next(x for x in lines if x.startswith("- N = 1, held-out sampled accuracy after 512 updates"))
    assert n1.startswith("- N = 1, held-out sampled accuracy after 512 updates: the evidence picks none; identical "
                         "updates: VESPO = GRPO = DPPO-TV = M2PO = VESPO + ESS step = DPPO-KL = GRPO + ESS step")
    assert not any("use **GRPO + ESS step**" in x or "use **DPPO-KL**" in x or "use **GRPO**" in x for x in lines)
    for x in lines:  # a loss behind another is never among the tied
        tied = re.search(r"tied(?: with them)?: ([^;]+)", x)
        behind = re.findall(r"; ([^;]+?) behind ", x)
        assert not tied or not set(tied.group(1).split(", ")) & set(behind), x
    assert all(re.match(r"- (N = \d+, )?held-out sampled accuracy after \d+ updates: ", x) for x in lines)


def test_the_collapse_rule_is_measured_against_what_it_can_miss(page):
    text = " ".join(page.split("**Collapse.**")[1].split("## The paper's claims")[0].split())
    assert "it calls 106 runs collapsed, and the rule missed 0 of them" in text
    assert "`staleness` `seed=2,N=64,loss=sapo` (final 0.127, warm start 0.251)" in text
    claims = cells(page.split("## The paper's claims")[1].split("How a row is decided")[0])
    sapo = next(r for r in claims if r[1].startswith("SAPO becomes unstable"))
    assert sapo[4].startswith("1/5 runs collapsed") and sapo[5] == "**partly**"


def _runs():
    return read_lab([ROOT / "docs" / "results" / n / "runs.json.gz" for n in SWEEPS])[1]


def test_the_collapse_rule_is_measured_against_partial_collapses(page):
    """The runs that ended below their warm start but not below half of it, recounted from the archives: how many,
    how many the rule flags, and each one it misses named with its last evaluation over its best so far."""
    runs = _runs()
    usable = runs[runs.usable & np.isfinite(runs.warm_start) & np.isfinite(runs.eval_sampled)]
    partial = usable[(usable.eval_sampled < usable.warm_start) & (usable.eval_sampled >= 0.5 * usable.warm_start)]
    missed = partial[~partial.collapsed]
    text = " ".join(page.split("**Collapse.**")[1].split("## The paper's claims")[0].split())
    said = re.search(r"Partial collapses: (\d+) runs ended below their warm start but not below half of it; the rule "
                     r"flagged (\d+) of them and misses (\d+)", text)
    assert said and [int(x) for x in said.groups()] == [len(partial), int(partial.collapsed.sum()), len(missed)]
    assert len(missed) > 0  # the rule does miss some: the page must name them
    for r in missed.itertuples():
        evals = [row["eval/reward_sampled"] for row in r.record.rows if "eval/reward_sampled" in row]
        best = max([r.record.before, *evals])
        assert f"`{r.run}` (final {r.eval_sampled:.3f}, warm start {r.warm_start:.3f}; last evaluation " \
               f"{evals[-1] / best:.2f} of its best" in text
        assert evals[-1] >= collapse.RULE.fraction * best  # why the rule lets it pass


def test_the_error_control_sentence_says_what_its_family_covers(page):
    """The Holm family's size recounted from the claims table: every test of a claim with a verdict, on its own
    metric; the collapse-count claims named as outside it, and the claims whose t-tests compare collapsing runs."""
    claims = cells(page.split("## The paper's claims")[1].split("How a row is decided")[0])[1:]
    with_tests = [r for r in claims if r[5] != "**—**" and ("difference:" in r[4] or r[4].startswith("collapses:"))]
    tests = sum(len(re.findall(r"\(Holm p [0-9.]+\)", r[4])) for r in with_tests)
    counts = [r[0] for r in claims if re.match(r"\d+/\d+ runs collapsed", r[4])]
    text = " ".join(page.split("**Error control.**")[1].split("\n\n")[0].split())
    assert f"the {tests} tests of the {len(with_tests)} claims decided by tests" in text
    assert f"the collapse counts (the claims numbered {', '.join(counts)}: each judged alone" in text
    assert "at most 10%" in text and "at most 30% together" in text
    sapo = next(r for r in claims if r[1].startswith("Under large N, VESPO ends above GRPO, GSPO and SAPO"))
    assert f"some runs collapsed (in the claims numbered {sapo[0]})" in text  # SAPO at N = 64: 1 of 5 collapsed


def test_no_collapse_is_an_upper_bound_and_pools_only_stale_runs(page):
    """Claims 8 and 22 saw no collapse: the verdict is the rate's exact one-sided 95% bound, 1 - 0.05^(1/n), on
    the runs that could collapse (VESPO at N = 8 and 64, not the on-policy N = 1)."""
    claims = {r[0]: r for r in cells(page.split("## The paper's claims")[1].split("How a row is decided")[0])[1:]}
    runs = _runs()
    stale = runs[(runs.sweep == "staleness") & (runs.loss == "vespo") & runs.N.isin(["8", "64"]) & runs.usable]
    for number, n in (("8", len(stale)), ("22", 5)):
        bound = 1 - 0.05 ** (1 / n)
        assert claims[number][4].startswith(f"0/{n} runs collapsed")
        assert claims[number][5] == f"**rate at most {bound:.2f}**", claims[number]


def test_the_end_point_is_measured(page):
    endpoint = page.split("### `endpoint`")[1]
    settle = next(t for t in re.findall(r"((?:^\|.*\n)+)", endpoint, flags=re.M) if "curves" in t)
    rows = {tuple(r[:2]): r[2:] for r in cells(settle)[1:]}
    assert rows[("1", "vespo")] == ["+0.027 [+0.008, +0.045]", "still rising"]
    assert rows[("64", "grpo")] == ["+0.038 [+0.023, +0.053]", "still rising"]
    together = " ".join(page.split("**Claims 1, 34 read together**")[1].split("\n\n")[0].split())
    assert "after 512 updates +0.004 [-0.022, +0.029]" in together and "after 2048 updates -0.077 [-0.120, -0.033]" \
        in together and "does not hold for the longer ones" in together


def _diff(runs, sweep, a, b, seeds=None):
    """a - b (losses, or N values for vespo) at N = 64, seed by seed, from the archives."""
    def values(where):
        cell = runs[(runs.sweep == sweep) & runs.usable]
        for k, v in where.items():
            cell = cell[cell[k] == v]
        return cell.set_index("seed").eval_sampled
    d = (values(a) - values(b)).dropna()
    return d if seeds is None else d[d.index.isin(seeds)]


def test_each_budget_is_shown_beside_the_longer_one_on_the_same_seeds(page):
    """VESPO - GRPO at N = 64 after 512 updates on the endpoint's 5 seeds, beside the same after 2048 updates: in
    the claims read together and under the recommendation's N = 64 line, recomputed from the archives."""
    runs = _runs()
    n64 = {"N": "64"}
    for loss in ("grpo", "dppo_tv"):
        long = _diff(runs, "endpoint", {**n64, "loss": "vespo"}, {**n64, "loss": loss})
        short = _diff(runs, "staleness", {**n64, "loss": "vespo"}, {**n64, "loss": loss}, long.index)
        assert len(long) == len(short) == 5
        both = f"on the 5 seeds both budgets ran: {ci_text(mean_ci(short), signed=True)} after 512 updates, " \
            f"{ci_text(mean_ci(long), signed=True)} after 2048"
        line = next(x for x in page.split("## Recommendation")[1].splitlines() if x.startswith("  - the same losses"))
        assert both in line, line
    long = _diff(runs, "endpoint", {**n64, "loss": "vespo"}, {**n64, "loss": "grpo"})
    short = _diff(runs, "staleness", {**n64, "loss": "vespo"}, {**n64, "loss": "grpo"}, long.index)
    together = " ".join(page.split("**Claims 2, 25 read together**")[1].split("\n\n")[0].split())
    assert f"On the 5 seeds both budgets ran, after 512 updates: {ci_text(mean_ci(short), signed=True)}" in together
    vs1 = _diff(runs, "endpoint", {**n64, "loss": "vespo"}, {"N": "1", "loss": "vespo"})
    vs1_short = _diff(runs, "staleness", {**n64, "loss": "vespo"}, {"N": "1", "loss": "vespo"}, vs1.index)
    together = " ".join(page.split("**Claims 1, 34 read together**")[1].split("\n\n")[0].split())
    assert f"On the 5 seeds both budgets ran, after 512 updates: {ci_text(mean_ci(vs1_short), signed=True)}" in together
    claims = cells(page.split("## The paper's claims")[1].split("How a row is decided")[0])
    assert claims[0][3] == "updates" and {r[3] for r in claims[1:] if r[2] == "endpoint"} == {"2048"}


def test_the_readmes_lab_numbers_recompute_and_say_what_they_are():
    """README's lab paragraphs: the staleness sweep's seed counts per loss, the async peers' differences (point
    estimates within 0.013, their intervals' reach) and the bypass result's 90% and 95% intervals, recomputed
    from the committed archives; the peers' numbers are said to be unadjusted."""
    readme = " ".join((ROOT / "README.md").read_text().split("## The lab")[1].split("## Datasets")[0].split())
    runs = read_lab([ROOT / "docs" / "results" / n / "runs.json.gz" for n in ("staleness", "async_peers",
                                                                               "mismatch_peers")])[1]
    words = {"VESPO": "vespo", "GRPO": "grpo", "DPPO-TV": "dppo_tv", "M2PO": "m2po", "GSPO": "gspo", "SAPO": "sapo",
             "VESPO with VCPO's ESS-scaled step size": "vespo_ess_lr", "DPPO-KL": "dppo_kl",
             "GRPO with the ESS step": "grpo_ess_lr"}
    ten, five = re.search(r"ten seeds for (.*?); five for (.*?)\)", readme).groups()
    listed = lambda text: {words[w] for w in re.split(r", and |, | and ", text)}  # noqa: E731
    staleness = runs[(runs.sweep == "staleness") & (runs.N == "64") & runs.usable]
    seeds = staleness.groupby("loss").seed.nunique()
    assert listed(ten) == set(seeds[seeds == 10].index) and listed(five) == set(seeds[seeds == 5].index)

    def diff(sweep, a, b):
        cell = runs[(runs.sweep == sweep) & runs.usable].set_index("seed")
        return (cell[cell.method == a].eval_sampled - cell[cell.method == b].eval_sampled).dropna()

    assert "unadjusted 90% intervals, not corrected" in readme
    pairs = [("grpo_opsm", "grpo"), ("vespo_opsm", "vespo"), ("prime_rl", "vespo")]
    cis = [mean_ci(diff("async_peers", a, b)) for a, b in pairs]
    assert max(abs(ci.mean) for ci in cis) <= 0.013 < max(max(-ci.low, ci.high) for ci in cis)
    assert f"lie within 0.013 (point estimates; their intervals reach from {min(ci.low for ci in cis):+.3f} to " \
           f"{max(ci.high for ci in cis):+.3f})" in readme
    bypass = diff("mismatch_peers", "reinforce_bypass_tis", "grpo")
    at90, at95 = mean_ci(bypass), mean_ci(bypass, 0.95)
    assert at90.high < 0 < at95.high and len(bypass) == 5
    assert f"minus GRPO is {ci_text(at90, signed=True)}, whose 95% interval, [{at95.low:+.3f}, {at95.high:+.3f}], " \
           "holds 0" in readme


def test_the_lab_script_makes_the_page_from_the_sweeps_the_page_shows():
    """`bash scripts/lab.sh` ends by regenerating docs/results.md from the sweeps it lists: where this machine has no
    run directories, from the committed archives. The sweeps (and their order) the page was generated from are
    the ones that list yields from the archives committed here: a sweep added to the page by hand, and not to the
    script, would drop off the page at the next `scripts/lab.sh` (three did: staleness_newer, async_newer and
    real_mismatch)."""
    script = (ROOT / "scripts" / "lab.sh").read_text()
    page_part = script[:script.index("--page docs/results.md")]
    listed = re.findall(r"\nfor sweep in ([^;]*); do\n", page_part)[-1]  # the last loop before the page's command
    sweeps = listed.replace("\\\n", " ").split()
    assert sweeps[:2] == ["staleness", "async"], sweeps
    in_progress = re.search(r'\[\[ "\$sweep" == ([^\]]*) \]\] && \[ -f "docs/results/in_progress', script).group(1)
    patterns = [part.replace('"$sweep" ==', "").strip() for part in in_progress.split("||")]  # *_peers, real_staleness

    def archive(sweep: str) -> str | None:  # the script's rule for a machine without run directories
        if any(fnmatch.fnmatch(sweep, pat) for pat in patterns) and \
                (ROOT / "docs" / "results" / "in_progress" / sweep / "runs.json.gz").is_file():
            return f"docs/results/in_progress/{sweep}/runs.json.gz"
        if (ROOT / "docs" / "results" / sweep / "runs.json.gz").is_file():
            return f"docs/results/{sweep}/runs.json.gz"
        return None

    expected = [a for a in map(archive, sweeps) if a]
    generated = re.search(r"Generated by `vespo report (.*?) --claims", (ROOT / "docs" / "results.md").read_text())
    assert generated.group(1).split() == expected
    on_disk = sorted(p.parent.name for p in (ROOT / "docs" / "results").glob("*/runs.json.gz"))
    assert sorted(Path(a).parent.name for a in expected) == on_disk  # no archive on the page's shelf left out
