"""The real-model route's user errors, each one line and exit status 2: a missing or corrupt GGUF file,
an unknown reasoning-gym dataset or option, a model without a chat template asked to use one."""

from test_cli_errors import FAST, assert_one_line, vespo


def test_a_missing_or_corrupt_gguf_file_is_one_line(tmp_path):
    done = vespo("train", *FAST, f"model.path={tmp_path / 'absent.gguf'}", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "model.path", "absent.gguf", "not found")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    done = vespo("train", *FAST, f"model.path={corrupt}", f"run.out_dir={tmp_path / 'r'}",
                 env={"VESPO_CACHE": str(tmp_path / "cache")})
    assert_one_line(done, "train", "model.path", "corrupt.gguf", "cannot be read as a causal LM")
    done = vespo("model", "get", str(corrupt), env={"VESPO_CACHE": str(tmp_path / "cache")})
    assert_one_line(done, "model", "MODEL_PATH", "corrupt.gguf")


def test_an_unknown_reasoning_gym_dataset_or_option_is_one_line(tmp_path):
    done = vespo("train", *FAST, "task.name=rg:chain_sumx", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "task", "unknown reasoning-gym dataset 'chain_sumx'", "chain_sum")
    done = vespo("train", *FAST, "task.name=rg:chain_sum", "task.options.min_termz=2", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "task", "'chain_sum' rejects its options", "min_termz")
    done = vespo("task", "export", "rg:nope", "--out", str(tmp_path / "data"))
    assert_one_line(done, "task", "unknown reasoning-gym dataset 'nope'")


def test_a_model_without_a_chat_template_asked_to_use_one_is_one_line(tmp_path):
    # the tiny models' character tokenizer has no chat template; reasoning-gym prompts are chat messages
    done = vespo("train", *FAST, "task.name=rg:chain_sum", "task.options={}", "rollout.max_new_tokens=8", f"run.out_dir={tmp_path / 'r'}")
    assert_one_line(done, "train", "task rg:chain_sum", "chat template", "task.options.chat=false")
