"""The `vespo ...` commands README.md and docs/*.md show run as written, shortened.

What counts as a command: a line of a shell code block (a fenced block marked bash, sh, shell,
console or nothing, or an indented block) whose first word is `vespo`, or the `vespo` part of a
`... && vespo ...` chain; a line ending in `\\` continues on the next. Commands quoted inline in
prose are references, not commands. A code-block line with text after a `\\` (a layout drawn in a
block) is not a command either.

How a command runs: through bash, in a workspace folder (one per document, holding a copy of
configs/ and stand-in files), with `vespo` on PATH running this checkout. The document's commands
run in their order, so a later one finds what an earlier one wrote (`vespo plot runs/demo ...`
after `vespo train`). Shortened: `vespo train` gets `run.steps=1` (2 with --resume: one step is
resumed), a 2-step warm start and 8 held-out problems; `vespo sweep` runs its whole grid when the
sweep file's own cost estimate is under a minute, else its first grid point only (`--only`),
shortened alike, with mini-batches of 1 prompt x 2 responses. A `vespo train` without --resume
starts in a fresh run directory (each command shown is an alternative a reader may try).
Placeholders (DIR, FILE, RUN_DIR..., `--config ...`) get stand-ins from STAND_INS; one without a
stand-in fails the test, naming it.

Skipped, with the reason: commands that need a GPU, vLLM or a model checkpoint, a running Ray
cluster, or the lab's finished sweeps; usage synopses ([optional] parts). README.md's quick
commands run by default (20-40 s on 2 cores); its sweep, report, Ray run and dataset evaluation,
and every other document's commands, are marked slow (about 4 minutes). A test runs its
document's earlier commands first when they have not run (what it may read), so any selection
works. Every `vespo train` command (all documents; Ray ones too) also has its config and
overrides loaded in process by default, as `vespo train` loads them before it starts: milliseconds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import vespo
from vespo.config import load_config, to_dict
from vespo.lab.grid import load_sweep
from vespo.trainer.cli import default_config_path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_]*(\.\.\.)?|\.\.\.)$")
SWEEP_BUDGET_S = 60.0  # a sweep estimated to take longer runs its first grid point only

TRAIN_SHORT = ["run.updates=0", "warmstart.steps=2", "task.eval_size=8", "run.progress=false"]
SKIPS = [  # (pattern in the command, reason, whether its config still loads here)
    (re.compile(r"rollout\.engine=vllm|model\.path=/"), "needs a CUDA device, vLLM and a model checkpoint", False),
    (re.compile(r"async\.ray_address=(?!local)\S+"), "joins a running Ray cluster", True),
    (re.compile(r"^vespo report runs/lab/"), ("reads the lab's finished sweeps (hours of CPU) and rewrites the "
                                              "results page; `vespo report` runs on a one-point sweep in README.md"),
     False),
    (re.compile(r"\[|SWEEP\.yaml"), "a usage synopsis, not a command", False),
]


@dataclass
class Command:
    document: str  # path relative to the repository
    line: int  # 1-based line where the command starts
    text: str  # as the document shows it, continuation lines joined
    tokens: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"


# ---- extraction ----------------------------------------------------------------------------------------

def shell_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line number of the block's first line, its lines) of every shell code block."""
    lines, blocks, k = text.splitlines(), [], 0
    while k < len(lines):
        fence = re.match(r"^\s*(```|~~~)\s*(\w*)", lines[k])
        if fence:
            end = next((j for j in range(k + 1, len(lines)) if lines[j].strip().startswith(fence.group(1))),
                       len(lines))
            if fence.group(2).lower() in SHELL_FENCES:
                blocks.append((k + 2, lines[k + 1 : end]))
            k = end + 1
        elif lines[k].startswith("    ") and (k == 0 or not lines[k - 1].strip()):
            end = k
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            blocks.append((k + 1, [line[4:] for line in lines[k:end]]))
            k = end
        else:
            k += 1
    return blocks


def commands_of(path: Path) -> list[Command]:
    """Every `vespo ...` command of a document's shell blocks, in document order."""
    found = []
    for first, block in shell_blocks(path.read_text(encoding="utf-8")):
        k = 0
        while k < len(block):
            start, logical = k, block[k]
            if re.search(r"\\\s+\S", block[k]):  # a layout: text after a continuation backslash
                k += 1
                continue
            while logical.rstrip().endswith("\\") and k + 1 < len(block):
                k += 1
                logical = logical.rstrip()[:-1] + " " + block[k].strip()
            k += 1
            for segment in chain_segments(logical):
                found.append(Command(str(path.relative_to(ROOT)), first + start, " ".join(segment), segment))
    return found


def chain_segments(line: str) -> list[list[str]]:
    """The `vespo ...` parts of one shell line (a leading `$ ` prompt and `# comments` dropped)."""
    line = re.sub(r"^\s*\$\s+", "", line)
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # unbalanced quotes: kept as words, so that bash reports the error when it runs
        tokens = line.split()
    segments, current = [], []
    for token in [*tokens, "&&"]:
        if token in ("&&", "||", ";", "|"):
            if current[:1] == ["vespo"] and len(current) > 1:
                segments.append(current)
            current = []
        else:
            current.append(token)
    return segments


COMMANDS = [command for document in DOCUMENTS for command in commands_of(document)]


def test_the_extractor_finds_the_readmes_commands():
    ids = {c.text: c.id for c in COMMANDS if c.document == "README.md"}
    for expected in ("vespo train", "vespo train --mode async run.out_dir=runs/async", "vespo kernels --out DIR",
                     "vespo train --help-config", "vespo eval --model DIR --data FILE --k aime24=32 --k math500=4"):
        assert expected in ids, sorted(ids)
    gpu = [c for c in COMMANDS if "rollout.engine=vllm" in c.text and c.document == "README.md"]
    assert gpu and gpu[0].tokens[-1] == "warmstart.enabled=false"  # a continuation line was joined
    assert not [c for c in COMMANDS if "learner actor" in c.text]  # docs/async.md's cluster layout
    sample = "x\n\n```bash\n$ vespo plot a b --out c.png  # note\nls && vespo kernels --out k\n```\n\n    vespo x\n"
    blocks = shell_blocks(sample)
    assert [chain_segments(line) for _, lines in blocks for line in lines] == [
        [["vespo", "plot", "a", "b", "--out", "c.png"]], [["vespo", "kernels", "--out", "k"]], [["vespo", "x"]]]


# ---- running them ---------------------------------------------------------------------------------------

STAND_INS = {  # (option before it or None, placeholder) -> what it stands for in the workspace
    ("--out", "DIR"): "out/{line}",
    ("--model", "DIR"): "runs/demo",
    ("--model", "RUN_DIR"): "runs/demo",
    ("--data", "FILE"): "data/eval.jsonl",
    ("--config", "..."): "configs/demo.yaml",
    (None, "RUN_DIR..."): "runs/demo runs/gspo32",
}

EVAL_ROWS = [{"data_source": source, "prompt": [{"role": "user", "content": f"{a}+{b}="}],
              "reward_model": {"ground_truth": str(a + b)}} for source, a, b in [("aime24", 12, 30),
                                                                                 ("math500", 7, 5)]]


def skip_reason(command: Command, loading_config: bool = False) -> str | None:
    """Why the command cannot run here (or, with ``loading_config``, why its config cannot load), or None."""
    return next((reason for pattern, reason, loads in SKIPS
                 if pattern.search(command.text) and not (loading_config and loads)), None)


def workspace(root: Path) -> Path:
    """A folder to run a document's commands in: configs/ (links followed), data/eval.jsonl, bin/vespo."""
    if not (root / "configs").exists():
        shutil.copytree(ROOT / "configs", root / "configs")
        (root / "data").mkdir()
        (root / "data" / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in EVAL_ROWS))
        (root / "bin").mkdir()
        shim = root / "bin" / "vespo"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vespo.cli "$@"\n')
        shim.chmod(0o755)
    return root


def with_stand_ins(command: Command) -> list[str]:
    tokens = []
    for previous, token in zip([None, *command.tokens], command.tokens):
        if PLACEHOLDER.match(token):
            key = (previous, token) if (previous, token) in STAND_INS else (None, token)
            if key not in STAND_INS:
                pytest.fail(f"{command.id}: placeholder {token!r} (after {previous!r}) has no stand-in; "
                            "add one to STAND_INS in tests/test_readme_commands.py")
            tokens += STAND_INS[key].format(line=command.line).split()
        else:
            tokens.append(token)
    return tokens


def train_parts(tokens: list[str]) -> tuple[str, list[str]]:
    """(the config file, the overrides with --mode as run.mode) of a `vespo train` command; without
    --config, the embedded demo, as `vespo train` reads it."""
    config = tokens[tokens.index("--config") + 1] if "--config" in tokens else default_config_path()
    overrides = [t for t in tokens[2:] if "=" in t and not t.startswith("-")]
    if "--mode" in tokens:
        overrides.append(f"run.mode={tokens[tokens.index('--mode') + 1]}")
    return config, overrides


def shortened(tokens: list[str], ws: Path) -> list[str]:
    """The command with shortening overrides placed after its own (one group of positionals)."""
    sub = tokens[1]
    if sub == "train" and "--help-config" not in tokens:
        extra = [*TRAIN_SHORT, f"warmstart.cache_dir={ws / 'cache'}", f"run.steps={2 if '--resume' in tokens else 1}"]
        if "smollm2" in " ".join(tokens):  # the real model: one mini-batch of 1 prompt x 2 short answers
            extra += ["staleness.minibatch_prompts=1", "rollout.group_size=2", "rollout.max_new_tokens=8",
                      "run.eval_every_updates=0"]
    elif sub == "sweep" and "--dry-run" not in tokens:
        tokens, extra = sweep_shortening(tokens, ws)
    else:
        return tokens
    last = max((k for k, t in enumerate(tokens) if k > 1 and "=" in t and not t.startswith("-")
                and tokens[k - 1] != "--only"), default=len(tokens) - 1)
    return tokens[: last + 1] + extra + tokens[last + 1 :]


def sweep_shortening(tokens: list[str], ws: Path) -> tuple[list[str], list[str]]:
    """(tokens, extra overrides): as written for a sweep estimated under SWEEP_BUDGET_S; else narrowed to
    the first grid point it names (each `--only` cut to its first value, one more per other axis),
    its run shortened."""
    sweep = load_sweep(ws / tokens[2])
    only = dict(tokens[k + 1].split("=", 1) for k, t in enumerate(tokens) if t == "--only")
    points = [p for p in sweep.points() if all(p.labels.get(a) in v.split(",") for a, v in only.items())]
    if sweep.cost is not None and sweep.cost.wall_s(len(points)) <= SWEEP_BUDGET_S:
        return tokens, []
    first = points[0].labels
    tokens = [t.split(",")[0] if k and tokens[k - 1] == "--only" else t for k, t in enumerate(tokens)]
    narrowed = [x for axis in sweep.axes if axis.label not in only
                for x in ("--only", f"{axis.label}={first[axis.label]}")]
    smaller = ["staleness.minibatch_prompts=1", "rollout.group_size=2"]  # N prompts x 2 per rollout step
    return tokens, ["run.steps=1", *TRAIN_SHORT, *smaller, f"warmstart.cache_dir={ws / 'cache'}", *narrowed]


def shell_join(tokens: list[str]) -> str:
    """Tokens as one bash line; globs stay unquoted so bash expands them as in the document."""
    return " ".join(t if re.fullmatch(r"[\w@%+=:,./*-]+", t) else shlex.quote(t) for t in tokens)


def fresh_run_dir(tokens: list[str], ws: Path) -> None:
    """A `vespo train` without --resume starts in a fresh run directory."""
    if tokens[1] != "train" or "--resume" in tokens or "--help-config" in tokens:
        return
    config, overrides = train_parts(tokens)
    out = ws / load_config(ws / config, overrides).run.out_dir
    shutil.rmtree(out, ignore_errors=True)


SLOW = re.compile(r"^vespo (sweep|report) |--mode async|--data |smollm2|offline:|rg:")
# a sweep, its report, Ray, a dataset's eval; the real pretrained model (tests/trainer/test_real_model.py
# trains it by default)


def is_slow(command: Command) -> bool:
    """README.md's quick commands run by default; the rest of README.md and every other document's are slow."""
    return command.document != "README.md" or bool(SLOW.search(command.text))


def tiered(command: Command):
    return pytest.param(command, id=command.id, marks=[pytest.mark.slow] if is_slow(command) else [])


class Session:
    """One document's commands run in order in one workspace; a command first runs the document's
    earlier commands that have not run yet (what it may read; for a quick command, the earlier quick
    ones), so any selection of tests works."""

    def __init__(self, document: str, root: Path):
        self.commands = [c for c in COMMANDS if c.document == document]
        self.ws = workspace(root)
        self.outcomes: dict[str, tuple[str, str]] = {}  # command id -> ("ok" | "skip" | "fail", message)
        self.lines: dict[str, str] = {}  # command line run -> the id that ran it

    def run(self, command: Command) -> tuple[str, str]:
        for earlier in self.commands[: self.commands.index(command) + 1]:
            if earlier.id not in self.outcomes and (is_slow(command) or not is_slow(earlier)):
                self.outcomes[earlier.id] = self._execute(earlier)
        failed = [f"{i}: {message}" for i, (kind, message) in self.outcomes.items()
                  if kind == "fail" and i != command.id]
        kind, message = self.outcomes[command.id]
        return kind, message + ("\nearlier commands that failed:\n" + "\n".join(failed) if failed else "")

    def _execute(self, command: Command) -> tuple[str, str]:
        reason = skip_reason(command)
        if reason:
            return "skip", f"{command.text}: {reason}"
        tokens = shortened(with_stand_ins(command), self.ws)
        line = shell_join(tokens)
        if line in self.lines:
            return "skip", f"the same command as {self.lines[line]}, already run"
        fresh_run_dir(tokens, self.ws)
        env = {k: v for k, v in os.environ.items() if k != "VESPO_DEBUG"}
        env.update(PATH=f"{self.ws / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(Path(vespo.__file__).resolve().parents[1]))
        done = subprocess.run(["bash", "-c", line], cwd=self.ws, env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        self.lines[line] = command.id
        if done.returncode != 0:
            return "fail", f"`{line}` exited {done.returncode}:\n{done.stderr[-3000:]}"
        return "ok", ""


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    made: dict[str, Session] = {}

    def get(document: str) -> Session:
        if document not in made:
            made[document] = Session(document, tmp_path_factory.mktemp(Path(document).stem.lower()))
        return made[document]

    return get


@pytest.mark.parametrize("command", [tiered(c) for c in COMMANDS])
def test_command_runs_as_written(command: Command, sessions):
    kind, message = sessions(command.document).run(command)
    if kind == "skip":
        pytest.skip(message)
    assert kind == "ok", f"{command.id}: {message}"


@pytest.mark.parametrize("command", [pytest.param(c, id=c.id) for c in COMMANDS
                                     if c.tokens[1] == "train" and "--help-config" not in c.tokens])
def test_train_command_config_loads(command: Command, monkeypatch, tmp_path):
    """Each `vespo train` command's config file and overrides load and validate (as `vespo train` does
    before it starts), Ray and GPU ones included."""
    reason = skip_reason(command, loading_config=True)
    if reason:
        pytest.skip(f"{command.text}: {reason}")
    monkeypatch.chdir(workspace(tmp_path))
    config, overrides = train_parts(with_stand_ins(command))
    resolved = to_dict(load_config(config, overrides))
    for item in overrides:  # each override reached the config the run would train with
        key, value = item.split("=", 1)
        node = resolved
        for part in key.split("."):
            node = node[part]
        assert node == yaml.safe_load(value) or str(node) == value, f"{command.id}: {key} is {node!r}, not {value}"
