"""The library's own exceptions.

Each one narrows a built-in error, so code that already catches ``TypeError`` or
``NotImplementedError`` keeps working, and code that wants only ours catches
``AssignTapeError``.
"""

from __future__ import annotations

__all__ = ["AssignTapeError", "ControlFlowWriteError", "NotAVariableError"]


class AssignTapeError(Exception):
    """Base class for every error raised by assigntape itself."""

    # AutoGraph re-raises an error from traced code as its own type only when
    # that type's __init__ is Exception's; otherwise the user gets a StagingError.
    __init__ = Exception.__init__


class NotAVariableError(AssignTapeError, TypeError):
    """An API that takes a variable was given something else."""


class ControlFlowWriteError(AssignTapeError, NotImplementedError):
    """A tracked variable was written inside a graph control-flow body.

    A version handle made inside a ``tf.cond`` branch or a ``tf.while_loop`` body
    cannot leave that body unless it is loop state, so the tape cannot carry the
    new version to later reads.
    """
