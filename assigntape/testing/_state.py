"""Saving and restoring the variables a function writes.

Which variables ``fn`` writes is known only once it has run, and by then their
values from before are gone. So the first run (the probe) happens under an
``AssignAwareTape`` whose write path is watched: each variable is saved the
first time a write to it is about to happen (the tape's write wrappers ask
``_serving.owner`` for the variable before the real write, the eager write
methods' short path asks ``_serving.short_path_scope``, and a
``tf.function`` that writes is refused or cut through
``_refusals.refuse_or_cut`` before it runs). The probe's ``history()`` then
names the written variables, and every one of them was saved before its
first write.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np
import tensorflow as tf

from assigntape import _refusals, _serving, _versions
from assigntape._tape import AssignAwareTape
from assigntape._tf import gen_resource_variable_ops, record

__all__ = ["SavedState", "probe"]


class SavedState:
    """The values some variables had, to write back with ``restore()``."""

    def __init__(self) -> None:
        self._saved: Dict[str, Tuple[Any, np.ndarray]] = {}

    def save(self, var: Any) -> None:
        """Saves ``var``'s present value, unless it is saved already."""
        if var._unique_id in self._saved:
            return
        # Eagerly (a write inside a function being traced happens after the
        # trace), from the variable's own handle, recorded on no tape. (Not
        # tf.raw_ops.ReadVariableOp: the patches map its handle to a version.)
        with tf.init_scope(), record.stop_recording():
            value = gen_resource_variable_ops.read_variable_op(_versions.canonical_handle(var), var.dtype)
        # np.array, not .numpy(): explain() notes values leaving TensorFlow
        # through .numpy() while a tape is open, and this one is not the user's.
        self._saved[var._unique_id] = (var, np.array(value, copy=True))

    def value(self, var: Any) -> np.ndarray:
        return self._saved[var._unique_id][1]

    def variables(self) -> List[Any]:
        return [var for var, _ in self._saved.values()]

    def restore(self) -> None:
        """Writes every saved variable back to its saved value."""
        for var, value in self._saved.values():
            var.assign(value)


@contextlib.contextmanager
def _saving_before_writes(state: SavedState) -> Iterator[None]:
    owner, refuse_or_cut, short_path_scope = _serving.owner, _refusals.refuse_or_cut, _serving.short_path_scope

    def saving_owner(tensor: Any) -> Any:
        found = owner(tensor)
        if found is not None:
            state.save(found[1])
        return found

    def saving_short_path_scope(var: Any) -> Any:
        # The eager write methods' short path names its variable here, not
        # through owner().
        scope = short_path_scope(var)
        if scope is not None:
            state.save(var)
        return scope

    def saving_refuse_or_cut(scopes: Any, var: Any, what: str, message: str) -> None:
        state.save(var)
        refuse_or_cut(scopes, var, what, message)

    _serving.owner, _refusals.refuse_or_cut = saving_owner, saving_refuse_or_cut
    _serving.short_path_scope = saving_short_path_scope
    try:
        yield
    finally:
        _serving.owner, _refusals.refuse_or_cut = owner, refuse_or_cut
        _serving.short_path_scope = short_path_scope


def written_names(tape: AssignAwareTape) -> List[str]:
    """The names of the variables ``tape`` saw written (its history)."""
    return list(tape.history().variables)


def probe(fn: Callable[[], Any], state: SavedState) -> Tuple[Any, AssignAwareTape]:
    """Runs ``fn`` once under an ``AssignAwareTape``, saving in ``state`` each
    variable it writes before the first write. Returns what ``fn`` returned.

    Writes inside ``tf.function``s are cut, not refused: the probe only needs
    values. If ``fn`` raises, what was saved is restored and the error goes on.
    Returns ``fn``'s result and the probe's tape (closed).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the cut writes' warnings
            with _saving_before_writes(state):
                with AssignAwareTape(untracked_writes="cut") as tape:
                    result = fn()
        # Every variable in the history was saved before its first write (the
        # write wrappers ask for its owner first); a miss here would mean a
        # write path that skips them, so check rather than trust.
        saved = {v.name for v in state.variables()}
        missed = [name for name in written_names(tape) if name.split(" (")[0] not in saved]
        if missed:
            raise RuntimeError(f"assigntape.testing: could not save {missed} before fn wrote them")
    except BaseException:
        state.restore()
        raise
    return result, tape
