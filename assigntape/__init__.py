"""assigntape: a ``tf.GradientTape`` through which gradients flow across variable writes.

See ``AssignAwareTape``.
"""

from assigntape import _autograph, _patches
from assigntape._errors import (
    AssignTapeError,
    ControlFlowWriteError,
    DuplicateIndicesError,
    NotAVariableError,
    SavedModelError,
    UntrackedWriteError,
)
from assigntape._diagnostics import Explanation, History, Reason
from assigntape._tape import AssignAwareTape
from assigntape._forward import ForwardAccumulator
from assigntape._patches import uninstall

__version__ = "0.1.0"

_autograph.exclude()
# Plain tapes are followed from import on, not only once the first
# AssignAwareTape installs the rest (see _patches.follow_plain_tapes).
_patches.follow_plain_tapes()

__all__ = [
    "AssignAwareTape",
    "AssignTapeError",
    "ControlFlowWriteError",
    "DuplicateIndicesError",
    "Explanation",
    "ForwardAccumulator",
    "History",
    "NotAVariableError",
    "Reason",
    "SavedModelError",
    "UntrackedWriteError",
    "uninstall",
]
