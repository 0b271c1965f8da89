"""Datasets known only by their variant tensor.

A ``Dataset`` object lists its functions and its inputs (``_datasets``). A
dataset rebuilt from its variant (``tf.data.experimental.from_variant``), a
raw variant tensor given to a ``tf.function``, or a dataset captured by a
``tf.function`` traced before ``import assigntape`` (whose trace noted
nothing) is only a variant: its functions can still be read from the
dataset's serialized graph, which TensorFlow's runtime makes from the
variant (its function library, every function the dataset runs, however
nested). Which variable a function writes is not said there (a resource is
serialized as a copy of its value), so such a write names its function
only, and is refused whatever the variable.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from assigntape import _rules
from assigntape._errors import ControlFlowWriteError, UntrackedWriteError
from assigntape._tf import dtypes, gen_dataset_ops, graph_pb2, ops

__all__ = ["UNLISTED_FIXES", "captured_writes", "context", "per_function", "refuse_unlisted", "unlisted_writes"]


class _Unlisted:
    """Stands for the function of a write whose variable is unknown (in a
    ``_functions.Write``): a refusal names it by ``graph.name``."""

    def __init__(self, name: str) -> None:
        self.graph = self  # (refusals name ``function.graph.name``)
        self.name = name


# ``ExternalStatePolicy.IGNORE``: a dataset whose functions hold resources
# (variables) is serialized all the same.
_IGNORE_EXTERNAL_STATE = 1


def unlisted_writes(variant: Any) -> List[Tuple[Any, str, Any]]:
    """For an eager variant tensor of a dataset: one write (handle ``None``,
    the op's type, the function) for each of its functions whose graph
    writes a variable (cached per tensor)."""
    if not isinstance(variant, ops.EagerTensor) or variant.dtype != dtypes.variant:
        return []
    cached = _cache.get(id(variant))
    if cached is not None and cached[0]() is variant:
        return cached[1]
    try:
        with ops.init_scope():  # (eagerly, also while a function is traced)
            serialized = gen_dataset_ops.dataset_to_graph_v2(
                variant, external_state_policy=_IGNORE_EXTERNAL_STATE, strip_device_assignment=True
            )
        graph = graph_pb2.GraphDef()
        graph.ParseFromString(serialized.numpy())
    except (tf.errors.OpError, ValueError, TypeError):
        return []  # not a dataset, or one TensorFlow cannot serialize: nothing known
    found: List[Tuple[Any, str, Any]] = []
    for function in graph.library.function:
        op_type = next((n.op for n in function.node_def if n.op in _rules.RULES or _rules.refused(n.op)), None)
        if op_type is not None:
            found.append((None, op_type, _Unlisted(function.signature.name)))
    key = id(variant)
    _cache[key] = (weakref.ref(variant, lambda _: _cache.pop(key, None)), found)
    return found


_cache: Dict[int, Tuple[Any, List[Tuple[Any, str, Any]]]] = {}


def captured_writes(function: Any, captured: List[Any]) -> List[Tuple[Any, str, Any]]:
    """``unlisted_writes`` of the dataset variants a concrete function
    captured (cached per function: its captures do not change)."""
    return per_function(
        _captures,
        function,
        lambda: [w for h in captured if getattr(h, "dtype", None) == dtypes.variant for w in unlisted_writes(h)],
    )


def per_function(cache: Any, function: Any, find: Callable[[], List[Any]]) -> List[Any]:
    """``find()``, cached in ``cache`` (weakly keyed) for ``function``: what
    its captures hold (they do not change)."""
    cached: Optional[List[Any]] = cache.get(function)
    if cached is None:
        cached = find()
        try:
            cache[function] = cached
        except TypeError:
            pass  # not weakly referable: found again next time
    return cached


_captures: "weakref.WeakKeyDictionary[Any, List[Tuple[Any, str, Any]]]" = weakref.WeakKeyDictionary()

UNLISTED_FIXES = (
    "Pass the Dataset object itself (a tf.function may take it as an argument), make the write "
    "outside dataset functions, and import assigntape before tracing functions that use datasets."
)


def context(writes: List[Tuple[Any, str, Any]], where: str) -> str:
    """Names the dataset functions that write, and what runs them."""
    names = ", ".join(sorted({repr(str(f.graph.name)) for _, _, f in writes}))
    return f"tf.data function {names} (run by {where})"


def refuse_unlisted(graph_tape: bool, writes: List[Tuple[Any, str, Any]], where: str) -> None:
    """Refuses ``writes`` (of ``unlisted_writes``), run by ``where``: their
    variable is unknown, so neither followed nor cut (``untracked_writes="cut"``
    cannot say what to cut)."""
    if not writes:
        return
    message = (
        f"{writes[0][1]} to a variable in {context(writes, where)} while an AssignAwareTape is open: the dataset is known only by its variant tensor, so the tape "
        "cannot tell which variable is written, and reads after it would credit the previous "
        "version, a silently wrong gradient. " + UNLISTED_FIXES
    )
    raise (ControlFlowWriteError if graph_tape else UntrackedWriteError)(message)
