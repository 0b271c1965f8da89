"""assigntape: a ``tf.GradientTape`` through which gradients flow across variable writes.

``AssignAwareTape`` takes the place of ``tf.GradientTape`` and
``ForwardAccumulator`` that of ``tf.autodiff.ForwardAccumulator``. Inside them
every write to a floating-point variable makes a new version, and gradients
follow the versions: the answer is that of the same program with each write
rebinding a tensor. A write they cannot follow raises an ``AssignTapeError``
before anything is written. ``assigntape.testing`` checks code that
differentiates through writes.
"""

from assigntape import _autograph, _patches
from assigntape._checkpoint import checkpointed
from assigntape._diagnostics import Explanation, History, Reason
from assigntape._errors import (
    AssignTapeError,
    ControlFlowWriteError,
    DuplicateIndicesError,
    ForkedTapeError,
    GraphWriteOrderError,
    NotAVariableError,
    RecomputeError,
    SavedModelError,
    UntrackedWriteError,
    WriteDtypeError,
)
from assigntape._forward import ForwardAccumulator
from assigntape._patches import uninstall
from assigntape._tape import AssignAwareTape
from assigntape._unroll import unroll

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
    "ForkedTapeError",
    "ForwardAccumulator",
    "GraphWriteOrderError",
    "History",
    "NotAVariableError",
    "Reason",
    "RecomputeError",
    "SavedModelError",
    "UntrackedWriteError",
    "WriteDtypeError",
    "checkpointed",
    "uninstall",
    "unroll",
]
