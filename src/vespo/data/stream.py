"""An endless stream of prompts in epochs, shuffled by a seed, with a cursor a checkpoint saves.

    stream = PromptStream(problems, seed=0)
    batch = stream.next_batch(64)        # crosses into the next epoch when one runs out
    state = stream.state_dict()          # {"seed", "epoch", "cursor", "num_problems", "shuffle"}
    PromptStream(problems, seed=0).load_state_dict(state)   # continues with the same batches

The state holds Python ints and a bool only, so a checkpoint loads it with
``torch.load(weights_only=True)``. A state that does not fit this stream raises ResumeError.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vespo.errors import ResumeError
from vespo.types import Problem


class PromptStream:
    """Problems in a fresh seeded order every epoch (file order when shuffle=False)."""

    def __init__(self, problems: list[Problem], seed: int, shuffle: bool = True):
        if not problems:
            raise ValueError("PromptStream needs at least one problem, got an empty list")
        self.problems, self.seed, self.shuffle = list(problems), int(seed), bool(shuffle)
        self.epoch, self.cursor = 0, 0  # cursor: position within this epoch's order
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.problems)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)  # [n], depends on (seed, epoch) only

    def next_batch(self, n: int) -> list[Problem]:
        """The next `n` problems; an epoch boundary may fall inside a batch."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"batch size n must be an integer >= 1, got {n!r}")
        batch = []
        while len(batch) < n:
            if self.cursor == len(self.problems):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(batch), len(self.problems) - self.cursor)
            batch += [self.problems[i] for i in self._order[self.cursor : self.cursor + take]]
            self.cursor += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": int(self.seed), "epoch": int(self.epoch), "cursor": int(self.cursor),
                "num_problems": len(self.problems), "shuffle": bool(self.shuffle)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved cursor; the stream must hold the same problems, seed and shuffle."""
        for key in ("seed", "epoch", "cursor", "num_problems", "shuffle"):
            if key not in state:
                raise ResumeError(f"PromptStream state is missing {key!r}; the checkpoint is damaged or not vespo's")
        mine = {"seed": self.seed, "num_problems": len(self.problems), "shuffle": self.shuffle}
        for key, value in mine.items():
            if state[key] != value:
                raise ResumeError(f"PromptStream state has {key}={state[key]!r} but this stream has {value!r}; "
                                  "resume with the data and seed the run started with (RUN_DIR/config.yaml)")
        if not 0 <= state["cursor"] <= len(self.problems) or state["epoch"] < 0:
            raise ResumeError(f"PromptStream state has an invalid position: epoch={state['epoch']!r}, "
                             f"cursor={state['cursor']!r} (of {len(self.problems)})")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order(self.epoch)
