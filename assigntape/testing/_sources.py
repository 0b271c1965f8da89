"""What a source of ``numerical_gradient`` / ``check_gradients`` stands for.

A source is a variable (its value before ``fn`` runs: version 0) or a version
handle from ``AssignAwareTape.versions(v)`` (the value right after the
``index``-th write to ``v``). A handle is a bare resource tensor: which variable
and which version it names is known only to the tape that made it, so that
tape is looked up among the live ones.
"""

from __future__ import annotations

import gc
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from assigntape import _resolve
from assigntape._diagnostics import variable_name
from assigntape._tape import AssignAwareTape

__all__ = ["Source", "resolve_sources"]


class Source(NamedTuple):
    """One source: the ``tf.Variable`` behind it and which of its versions."""

    variable: Any  # the tf.Variable (a Keras 3 variable resolved to it)
    version: int  # 0: the value before fn runs; k: right after fn's k-th write to it
    name: str  # for messages and the mismatch table


def _flatten(sources: Any) -> List[Any]:
    if isinstance(sources, (list, tuple)):
        return list(sources)
    return [sources]


def _version_of(handle: Any) -> Optional[Tuple[Any, int]]:
    """The variable and version index of a version handle, asked of the live
    ``AssignAwareTape`` that made it (None if no live tape knows it)."""
    for obj in gc.get_objects():
        if not isinstance(obj, AssignAwareTape):
            continue
        # Every variable the tape knows: written (its ``_owners``), read, or
        # written by a tape outside it before it started.
        candidates = list(obj._record.owners.values()) + list(obj._record.start_owners.values())
        candidates += [_resolve.resolve(v) for v in obj.watched_variables()]
        for var in candidates:
            if var is None:
                continue
            for i, version in enumerate(obj.versions(var)):
                if version is handle:
                    return var, i
    return None


def resolve_sources(sources: Any) -> List[Source]:
    """Each source as a ``Source``.

    Raises:
      TypeError: a source is neither a variable nor a version handle, or its
        dtype is not floating-point or complex.
      ValueError: a resource tensor that no live ``AssignAwareTape`` knows.
    """
    flat = _flatten(sources)
    if not flat:
        raise ValueError("sources is empty: give at least one variable or version handle")
    resolved: List[Source] = []
    for position, given in enumerate(flat):
        var = _resolve.resolve(given)
        if var is not None:
            source = Source(var, 0, variable_name(var, given))
        elif isinstance(given, tf.Tensor) and given.dtype == tf.resource:
            found = _version_of(given)
            if found is None:
                raise ValueError(
                    f"sources[{position}] is a resource tensor that no live AssignAwareTape "
                    "knows as a version: pass a handle from tape.versions(variable), and keep "
                    "that tape alive until the check is done."
                )
            var, index = found
            source = Source(var, index, f"{var.name} (version {index})")
        else:
            raise TypeError(
                f"sources[{position}] is a {type(given).__name__}: each source must be a "
                "tf.Variable, a Keras variable, or a version handle from AssignAwareTape.versions()."
            )
        if not (var.dtype.is_floating or var.dtype.is_complex):
            raise TypeError(
                f"source {source.name!r} has dtype {var.dtype.name}: only floating-point and "
                "complex variables have gradients."
            )
        resolved.append(source)
    return resolved


def names(sources: Sequence[Source]) -> List[str]:
    return [s.name for s in sources]
