"""PromptStream: seeded epochs, batches across epoch boundaries, resuming from a saved cursor."""

from __future__ import annotations

import pytest

from vespo.data import PromptStream
from vespo.types import Problem


def make_problems(n):
    return [Problem(id=str(i), prompt=f"{i}=", ground_truth=str(i)) for i in range(n)]


def ids(batch):
    return [p.id for p in batch]


def test_every_epoch_is_a_permutation_and_epochs_differ():
    stream = PromptStream(make_problems(10), seed=3)
    first, second = ids(stream.next_batch(10)), ids(stream.next_batch(10))
    assert sorted(first, key=int) == [str(i) for i in range(10)] == sorted(second, key=int)
    assert first != second and stream.epoch == 1


def test_same_seed_same_order_other_seed_other_order():
    a = ids(PromptStream(make_problems(20), seed=1).next_batch(45))
    b = ids(PromptStream(make_problems(20), seed=1).next_batch(45))
    c = ids(PromptStream(make_problems(20), seed=2).next_batch(45))
    assert a == b and a != c


def test_no_shuffle_streams_in_file_order_and_wraps():
    stream = PromptStream(make_problems(3), seed=0, shuffle=False)
    assert ids(stream.next_batch(2)) == ["0", "1"]
    assert ids(stream.next_batch(5)) == ["2", "0", "1", "2", "0"]  # epoch 1 and 2 begin inside
    assert stream.epoch == 2 and stream.cursor == 1


def test_batch_across_an_epoch_boundary_finishes_the_epoch_first():
    stream = PromptStream(make_problems(5), seed=0)
    head = ids(stream.next_batch(3))
    mixed = ids(stream.next_batch(4))
    assert sorted(head + mixed[:2], key=int) == ["0", "1", "2", "3", "4"]  # epoch 0 complete
    assert stream.epoch == 1 and stream.cursor == 2


def test_resume_from_state_dict_gives_the_same_next_batches():
    problems = make_problems(7)
    stream = PromptStream(problems, seed=5)
    stream.next_batch(4)
    stream.next_batch(6)  # now inside epoch 1
    state = stream.state_dict()
    expected = [ids(stream.next_batch(3)) for _ in range(5)]

    resumed = PromptStream(problems, seed=5)
    resumed.load_state_dict(state)
    assert [ids(resumed.next_batch(3)) for _ in range(5)] == expected
    assert state == {"seed": 5, "epoch": 1, "cursor": 3, "num_problems": 7, "shuffle": True}


def test_state_from_another_stream_is_rejected():
    state = PromptStream(make_problems(7), seed=5).state_dict()
    with pytest.raises(ValueError, match="num_problems=7 but this stream has 8"):
        PromptStream(make_problems(8), seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=5 but this stream has 6"):
        PromptStream(make_problems(7), seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="missing 'epoch'"):
        PromptStream(make_problems(7), seed=5).load_state_dict({"seed": 5})
    with pytest.raises(ValueError, match="invalid position"):
        PromptStream(make_problems(7), seed=5).load_state_dict({**state, "cursor": 9})


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one problem"):
        PromptStream([], seed=0)
    with pytest.raises(ValueError, match="batch size n must be an integer >= 1, got 0"):
        PromptStream(make_problems(2), seed=0).next_batch(0)
