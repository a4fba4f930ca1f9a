"""Checkpoints open without running code (trainer.pt with torch.load(weights_only=True), the dcp index with an
unpickler that admits only its metadata types): RNG streams, optimizer, scheduler and data cursor round-trip
exactly, and a trainer.pt or an index whose unpickling would run code is refused unopened."""

import pickle
import random

import numpy as np
import pytest
import torch

from vespo.config import load_config
from vespo.data import PromptStream
from vespo.errors import CheckpointError, ResumeError, UserError
from vespo.models import build_char_tokenizer, tiny_model
from vespo.tasks import get_task
from vespo.trainer.checkpoint import STATE_FILE, latest_checkpoint, load_checkpoint, save_checkpoint
from vespo.trainer.learner import Learner


def draws() -> dict:
    """A few values from every generator a run uses, including the cached Gaussians."""
    return {"python": [random.random() for _ in range(4)] + [random.gauss(0, 1)],
            "numpy": np.random.rand(4).tolist() + [np.random.normal()],
            "torch": torch.rand(4).tolist() + torch.randn(3).tolist()}


def test_rng_states_round_trip_to_the_exact_streams(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.gauss(0, 1), np.random.normal()  # leave a cached Gaussian in both (gauss_next, has_gauss)
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1
    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path, 1, model, None, {"step": 1}, config={})
    expected = draws()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    assert draws() != expected
    state = load_checkpoint(path, torch.nn.Linear(3, 2))
    assert state == {"step": 1}
    assert draws() == expected


def _learner(model, total=20):
    cfg = load_config(None, ["model.device=cpu", "optim.lr=1e-2", "optim.schedule=cosine", "optim.warmup_steps=2",
                             "optim.weight_decay=0.1", f"run.steps={total}", "staleness.n=1"])
    return Learner(model, cfg)


def _optimizer_step(learner, seed):
    """One AdamW + LambdaLR step on a fixed random gradient (the state a real update leaves)."""
    gen = torch.Generator().manual_seed(seed)
    for p in learner.params:
        p.grad = torch.randn(p.shape, generator=gen)
    learner.optimizer.step()
    learner.scheduler.step()
    learner.version += 1


def test_learner_stream_and_counters_round_trip_and_continue_identically(tmp_path):
    tok = build_char_tokenizer()
    problems = get_task("addition", digits=1).generate(50, seed=0)
    model, stream = tiny_model("qwen3", "nano", tokenizer=tok, seed=0), PromptStream(problems, seed=7)
    learner = _learner(model)
    for seed in range(3):
        _optimizer_step(learner, seed)
        stream.next_batch(16)
    state = {"step": 3, "tickets": 12, "learner": learner.state_dict(), "stream": stream.state_dict()}
    path = save_checkpoint(tmp_path, 3, learner.module, learner.optimizer, state, config={"run": {"seed": 0}})
    assert latest_checkpoint(tmp_path) == path
    torch.load(path / STATE_FILE, weights_only=True)  # the whole trainer state is plain data

    model2, stream2 = tiny_model("qwen3", "nano", tokenizer=tok, seed=1), PromptStream(problems, seed=7)
    learner2 = _learner(model2)
    loaded = load_checkpoint(path, learner2.module, learner2.optimizer)
    learner2.load_state_dict(loaded["learner"])
    stream2.load_state_dict(loaded["stream"])
    assert (loaded["step"], loaded["tickets"], learner2.version) == (3, 12, 3)
    assert learner2.scheduler.get_last_lr() == learner.scheduler.get_last_lr()
    assert [p.id for p in stream2.next_batch(16)] == [p.id for p in stream.next_batch(16)]
    _optimizer_step(learner, 10)
    _optimizer_step(learner2, 10)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


class WritesAFile:
    """Unpickling this runs code: it writes ``target``."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return exec, (f"open({self.target!r}, 'w').write('code ran')",)


def test_a_trainer_state_whose_loading_would_run_code_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path, 1, model, None, {"step": 1}, config={})
    live, target = tmp_path / "live.pt", tmp_path / "pwned.txt"
    torch.save({"step": 1, "payload": WritesAFile(live.with_suffix(".txt"))}, live)
    torch.load(live, weights_only=False)  # the payload is real: an unsafe load runs it
    assert live.with_suffix(".txt").read_text() == "code ran"

    torch.save({"step": 1, "payload": WritesAFile(target)}, path / STATE_FILE)
    fresh = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"trainer.pt holds objects other than tensors.*GLOBAL exec.*could run code"):
        load_checkpoint(path, fresh)
    assert not target.exists()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # weights untouched


def test_a_shard_index_whose_loading_would_run_code_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path, 1, model, None, {"step": 1}, config={})
    target = tmp_path / "pwned.txt"
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(WritesAFile(target)))
    with pytest.raises(CheckpointError, match=r"\.metadata holds objects other than checkpoint metadata"):
        load_checkpoint(path, torch.nn.Linear(3, 2))
    assert not target.exists()


def test_saving_a_state_that_would_not_load_names_the_value(tmp_path):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"trainer state.stream.cursor is a numpy.int64"):
        save_checkpoint(tmp_path, 1, model, None, {"stream": {"cursor": np.int64(3)}}, config={})
    with pytest.raises(TypeError, match=r"trainer state.extra\[1\] is a numpy.ndarray"):
        save_checkpoint(tmp_path, 1, model, None, {"extra": [1, np.zeros(2)]}, config={})
    assert latest_checkpoint(tmp_path) is None


def test_damaged_checkpoints_and_other_models_raise_user_errors(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path, 1, model, None, {"step": 1}, config={})
    with pytest.raises(ResumeError, match=r"dcp holds the weights of another model"):
        load_checkpoint(path, torch.nn.Linear(4, 2))
    (path / STATE_FILE).write_bytes((path / STATE_FILE).read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"trainer.pt cannot be read"):
        load_checkpoint(path, model)
    (path / STATE_FILE).unlink()
    with pytest.raises(UserError, match=r"has no trainer.pt; it is incomplete"):
        load_checkpoint(path, model)
