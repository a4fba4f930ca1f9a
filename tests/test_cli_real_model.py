"""The real-model route's user errors, each one line and exit status 2 from `vespo` (run in process): a missing
or corrupt GGUF file, an unknown reasoning-gym dataset or option, a model without a chat template asked to
use one, activation checkpointing where it cannot act."""

import pytest

from test_cli_errors import FAST

from vespo import cli


@pytest.fixture
def vespo(capsys, monkeypatch, tmp_path):
    """`vespo ARGS` in this process: (exit status, the one line it printed on stderr)."""
    monkeypatch.setenv("VESPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VESPO_DEBUG", raising=False)

    def run(*args: str) -> tuple[int, str]:
        status = cli.main(list(args))
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in lines[0], lines
        return status, lines[0]

    return run


def _one_line(result: tuple[int, str], command: str) -> str:
    """The error line of a `vespo COMMAND` that exited 2 (a usage error), for the test to check its words."""
    status, line = result
    assert status == 2 and line.startswith(f"vespo {command}: error: "), line
    return line


def _names(line: str, *names: str) -> bool:
    return all(name in line for name in names)


def test_a_missing_or_corrupt_gguf_file_is_one_line(vespo, tmp_path):
    out = f"run.out_dir={tmp_path / 'r'}"
    assert _names(_one_line(vespo("train", *FAST, f"model.path={tmp_path / 'absent.gguf'}", out), "train"),
                  "model.path", "absent.gguf", "not found")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert _names(_one_line(vespo("train", *FAST, f"model.path={corrupt}", out), "train"),
                  "model.path", "corrupt.gguf", "cannot be read as a causal LM")
    assert _names(_one_line(vespo("model", "get", str(corrupt)), "model"),
                  "MODEL_PATH", "corrupt.gguf")


def test_an_unknown_reasoning_gym_dataset_or_option_is_one_line(vespo, tmp_path):
    out = f"run.out_dir={tmp_path / 'r'}"
    assert _names(_one_line(vespo("train", *FAST, "task.name=rg:chain_sumx", "task.options={}", out), "train"),
                  "task", "unknown reasoning-gym dataset 'chain_sumx'", "chain_sum")
    line = _one_line(vespo("train", *FAST, "task.name=rg:chain_sum", "task.options={min_termz: 2}", out), "train")
    assert _names(line,
                  "task", "'chain_sum' rejects its options", "min_termz")
    assert _names(_one_line(vespo("task", "export", "rg:nope", "--out", str(tmp_path / "data")), "task"),
                  "unknown reasoning-gym dataset 'nope'")


def test_a_model_without_a_chat_template_asked_to_use_one_is_one_line(vespo, tmp_path):
    # the tiny models' character tokenizer has no chat template; reasoning-gym prompts are chat messages
    line = _one_line(vespo("train", *FAST, "task.name=rg:chain_sum", "task.options={}", "rollout.max_new_tokens=8",
                           f"run.out_dir={tmp_path / 'r'}"), "train")
    assert _names(line,
                  "task rg:chain_sum", "chat template", "task.options.chat=false")


@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_checkpointing_with_router_replay_is_one_line(vespo, tmp_path, replay):
    # a layer recomputed in backward would route afresh, so the replayed experts would not hold there
    line = _one_line(vespo("train", *FAST, "model.arch=qwen3_moe", f"rollout.router_replay={replay}",
                           "model.gradient_checkpointing=true", f"run.out_dir={tmp_path / 'r'}"), "train")
    assert _names(line,
                  "model.gradient_checkpointing=true", "router replay")
    assert not (tmp_path / "r").exists()  # refused before the run directory is made
