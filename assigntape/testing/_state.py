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
first write. A ``tf.function``'s writes are read from its graph
(``_functions.function_writes``) before it runs: every variable behind them is
saved, whatever its dtype (an optimizer's integer ``iterations`` too, which
the tape does not version but which changes what the next run computes).

A variable ``fn`` creates inside a ``tf.function`` on its first call (a
Keras optimizer's slots, built lazily in a compiled step) is initialized only
inside that call, right before its first write: no value of it from before
exists. (When TensorFlow lifts their initializers out, they are
initialized by a function of their own first, and saved when the step
itself runs: no problem.) Otherwise the probe runs ``fn`` a second time, from
the state it saved with those variables as the first run left them, and that
state is the one put back.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np
import tensorflow as tf

from assigntape import _functions, _refusals, _serving, _versions
from assigntape._tape import AssignAwareTape
from assigntape._tf import gen_resource_variable_ops, record

__all__ = ["SavedState", "probe"]


class SavedState:
    """The values some variables had, to write back with ``restore()``."""

    def __init__(self) -> None:
        self._saved: Dict[str, Tuple[Any, np.ndarray]] = {}
        # Variables first seen before they were initialized (made by a
        # tf.function on its first call, while it runs): not saved.
        self.uninitialized: Dict[str, Any] = {}

    def save(self, var: Any) -> None:
        """Saves ``var``'s present value, unless it is saved already (or
        notes it in ``uninitialized``, if it has no value yet)."""
        if var._unique_id in self._saved:
            return
        with tf.init_scope(), record.stop_recording():
            initialized = bool(gen_resource_variable_ops.var_is_initialized_op(_versions.canonical_handle(var)))
        if not initialized:
            self.uninitialized[var._unique_id] = var
            return
        # Eagerly (a write inside a function being traced happens after the
        # trace), from the variable's own handle, recorded on no tape. (Not
        # tf.raw_ops.ReadVariableOp: the patches map its handle to a version.)
        with tf.init_scope(), record.stop_recording():
            value = gen_resource_variable_ops.read_variable_op(_versions.canonical_handle(var), var.dtype)
        # np.array, not .numpy(): explain() notes values leaving TensorFlow
        # through .numpy() while a tape is open, and this one is not the user's.
        self._saved[var._unique_id] = (var, np.array(value, copy=True))

    def unsaved(self) -> List[Any]:
        """The variables seen uninitialized and not saved since."""
        return [var for key, var in self.uninitialized.items() if key not in self._saved]

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

    def saving_function_writes(function: Any, handles: List[Any]) -> List[Any]:
        # Every variable a function writes, before it runs: also those the
        # tape does not version (integers), which refuse_or_cut never sees.
        writes = function_writes(function, handles)
        for handle, _, _ in writes:
            var = None if handle is None else _functions._variable_behind(function, handle, None)
            if var is not None:
                state.save(var)
        return writes

    function_writes = _functions.function_writes
    _serving.owner, _refusals.refuse_or_cut = saving_owner, saving_refuse_or_cut
    _serving.short_path_scope = saving_short_path_scope
    _functions.function_writes = saving_function_writes
    try:
        yield
    finally:
        _serving.owner, _refusals.refuse_or_cut = owner, refuse_or_cut
        _serving.short_path_scope = short_path_scope
        _functions.function_writes = function_writes


def written_names(tape: AssignAwareTape) -> List[str]:
    """The names of the variables ``tape`` saw written (its history)."""
    return list(tape.history().variables)


def probe(fn: Callable[[], Any], state: SavedState) -> Tuple[Any, AssignAwareTape]:
    """Runs ``fn`` once under an ``AssignAwareTape``, saving in ``state`` each
    variable it writes before the first write. Returns what ``fn`` returned.

    Writes inside ``tf.function``s are cut, not refused: the probe only needs
    values. If ``fn`` raises, what was saved is restored and the error goes on.
    Returns ``fn``'s result and the probe's tape (closed). If ``fn`` made
    variables that a ``tf.function`` initializes as it runs, ``fn`` runs once
    more (see the module's doc).
    """
    result, tape = _probe_once(fn, state)
    if state.unsaved():
        del tape
        state.restore()
        result, tape = _probe_once(fn, state)
        if state.unsaved():
            state.restore()
            names = [v.name for v in state.unsaved()]
            raise RuntimeError(
                f"assigntape.testing: fn creates variables {names} in a tf.function on every call: no state "
                "to put back between runs exists. Create them once, outside fn."
            )
    return result, tape


def _probe_once(fn: Callable[[], Any], state: SavedState) -> Tuple[Any, AssignAwareTape]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the cut writes' warnings
            with _saving_before_writes(state):
                with AssignAwareTape(untracked_writes="cut") as tape:
                    result = fn()
        # Every variable in the history was saved before its first write (the
        # write wrappers ask for its owner first); a miss here would mean a
        # write path that skips them, so check rather than trust.
        saved = {v.name for v in state.variables() + state.unsaved()}
        missed = [name for name in written_names(tape) if name.split(" (")[0] not in saved]
        if missed:
            raise RuntimeError(f"assigntape.testing: could not save {missed} before fn wrote them")
    except BaseException:
        state.restore()
        raise
    return result, tape
