"""assigntape: a ``tf.GradientTape`` through which gradients flow across variable writes.

See ``AssignAwareTape``.
"""

from assigntape._errors import (
    AssignTapeError,
    ControlFlowWriteError,
    DuplicateIndicesError,
    NotAVariableError,
    UntrackedWriteError,
)
from assigntape._tape import AssignAwareTape

__version__ = "0.1.0"

__all__ = [
    "AssignAwareTape",
    "AssignTapeError",
    "ControlFlowWriteError",
    "DuplicateIndicesError",
    "NotAVariableError",
    "UntrackedWriteError",
]
