"""Gradient rules for the writes the tape understands: a plain dict, by method.

A rule says what a write's new version is made of: which inputs the recorded op
has (the written value, and the previous version for a partial write) and how the
gradient arriving at the new version is routed back to them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple

from tensorflow.python.framework import indexed_slices
from tensorflow.python.ops import math_ops

__all__ = ["Rule", "RULES"]


class Rule(NamedTuple):
    op_type: str
    # Whether the new version keeps part of the previous one. Such a write reads
    # the old value, so the previous version is an input of the recorded op.
    reads_old: bool
    # Maps the gradient of the new version to the gradients of the inputs:
    # [previous version, value] when reads_old, else [value].
    backward: Callable[[Any], List[Any]]


def _negate(g: Any) -> Any:
    # Gradients that reach a version through tf.gather / embedding lookups are
    # IndexedSlices; keep them sparse.
    if isinstance(g, indexed_slices.IndexedSlices):
        return indexed_slices.IndexedSlices(
            math_ops.negative(g.values), g.indices, g.dense_shape
        )
    return math_ops.negative(g)


RULES: Dict[str, Rule] = {
    "assign": Rule("AssignTape:Assign", False, lambda g: [g]),
    "assign_add": Rule("AssignTape:AssignAdd", True, lambda g: [g, g]),
    "assign_sub": Rule("AssignTape:AssignSub", True, lambda g: [g, _negate(g)]),
}
