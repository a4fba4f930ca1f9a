"""Errors a user can act on: a bad config value, dataset row, import path, run directory or checkpoint.

Each is a ``UserError``. The ``vespo`` command prints its message as one line (naming the field,
file or row and what to do) and exits with status 2, without a traceback; ``vespo --debug ...``
or ``VESPO_DEBUG=1`` shows the traceback too. Any other exception is a bug or an environment
failure and keeps its traceback.

A run that Ctrl-C or SIGTERM stops (its step finished and checkpointed) exits with status 130 (``INTERRUPTED``,
the shell's code for SIGINT) and its summary says "interrupted", so that a scheduler tells it from
a finished run and from a failed one.

Each subclass also derives from the built-in exception it replaces (ValueError, FileNotFoundError,
FileExistsError), so code that catches those keeps working.

    UserError
      ConfigError        a config field is unknown, missing or out of range   (vespo.config)
      SweepError         a sweep file is malformed                           (vespo.lab.grid)
      DataError          a dataset file, row or field is malformed
      MissingPathError   a file or directory the user named does not exist
      ModelError         a model directory cannot be used as a policy
      RewardFnError      a reward function import path does not give a usable function
      UsageError         a command-line option of a vespo command is malformed
      RunDirError        the run directory already holds another run
      ResumeError        a run cannot continue from its checkpoint
      CheckpointError    a checkpoint is incomplete or holds something other than tensors and plain data
      DiskFullError      the disk (or quota, or file size limit) has no room for a file the run writes
"""

from __future__ import annotations

import errno
import os
import re

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (SIGINT) at a checkpoint: resumable, not failed


class UserError(Exception):
    """A mistake in what the user asked for; its message says what is wrong and what to do."""


class DataError(UserError, ValueError):
    """A dataset file, row or field is malformed; the message names the file and the row."""


class MissingPathError(UserError, FileNotFoundError):
    """A file or directory named in a config field or a command-line option does not exist."""


class ModelError(UserError, ValueError):
    """A model directory (or checkpoint) cannot be used as a policy."""


class RewardFnError(UserError, ValueError):
    """A reward import path ('package.module:function') does not give a usable function."""


class UsageError(UserError, ValueError):
    """A command-line option of a vespo command is malformed."""


class RunDirError(UserError, FileExistsError):
    """The run directory already holds a run that this command would overwrite."""


class ResumeError(UserError, ValueError):
    """A run cannot be resumed from its checkpoint (none there, or written for another config)."""


class StartError(UserError, ValueError):
    """The seed's shared on-policy start is below warmstart.min_accuracy: no run trains from it."""


class CheckpointError(UserError, ValueError):
    """A checkpoint is incomplete, unreadable, or holds objects whose loading could run code."""


class DiskFullError(UserError, OSError):
    """A file the run writes (a checkpoint, a metrics or samples row) found no room; the message names it, says
    what on disk stands, and ends with FREE_AND_RESUME."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, over the file size limit
FREE_AND_RESUME = "free disk space, then rerun with --resume"


def disk_full(error: BaseException) -> OSError | None:
    """The OSError of a full disk (or quota, or file size limit) behind ``error``, as its causes, its context,
    torch.distributed.checkpoint's per-rank failures or a Rust writer's message ("(os error 28)") hold it, or None."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return e
        if (code := _os_error_code(e)) in DISK_FULL:  # safetensors' Rust writer: "I/O error: ... (os error 28)"
            return OSError(code, os.strerror(code))
        failures = getattr(e, "failures", {}).values()  # dcp's CheckpointException: rank -> (exception, traceback)
        todo += [e.__cause__, e.__context__, *(f[0] if isinstance(f, tuple) else f for f in failures)]
    return None


def _os_error_code(error: BaseException) -> int | None:
    """The errno a non-OSError names in its message as Rust's io::Error prints it ("... (os error 27)"), or None."""
    found = None if isinstance(error, OSError) else re.search(r"\(os error (\d+)\)", str(error))
    return int(found.group(1)) if found else None


def debug_requested(argv: list[str]) -> bool:
    """True when ``--debug`` is among the arguments or VESPO_DEBUG is set to a non-empty, non-zero value."""
    return "--debug" in argv or os.environ.get("VESPO_DEBUG", "").strip() not in ("", "0")


def one_line(error: BaseException) -> str:
    """The error's message on one line (its lines joined by '; ')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__
