"""Patches other libraries make on the functions assigntape patches.

The dormant switches (``_versions.switches``) and ``uninstall()`` put back
only what is still assigntape's: a wrapt or mock patch made after the first
tape, around ours or in place of TensorFlow's while ours was off, stays, and
ours keeps running inside it while a tape is open.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, List
from unittest import mock

import pytest
import tensorflow as tf
import wrapt
from tensorflow.python.eager import backprop
from tensorflow.python.ops import gen_resource_variable_ops as grv

import assigntape
from assigntape import AssignAwareTape, _versions
from assigntape._wrapping import Wrapper

# (owner, attribute, a call outside every tape that goes through it)
_PLACES = {
    "assign_variable_op": (grv, "assign_variable_op", lambda v: v.assign(5.0)),
    "assign_add_variable_op": (grv, "assign_add_variable_op", lambda v: v.assign_add(0.0)),
    "GradientTape.gradient": (backprop.GradientTape, "gradient", lambda v: _plain_gradient(v)),
}


def _plain_gradient(v: tf.Variable) -> Any:
    with tf.GradientTape() as tape:
        y = v * 2.0
    return tape.gradient(y, v)


def _hypergradient() -> float:
    """d/da of y = v * v after v.assign(a * 3): by hand, 2 * (3a) * 3 = 18a = 36 at a = 2."""
    a, v = tf.Variable(2.0), tf.Variable(1.0)
    with AssignAwareTape() as tape:
        v.assign(a * 3.0)
        v.assign_add(a * 0.0)  # through assign_add_variable_op too
        y = v * v
    return float(tape.gradient(y, a))


def _idle() -> None:
    """Lets every closed tape go, so that the next dormant call takes the switches off."""
    gc.collect()


def _remove(owner: Any, name: str, theirs: Any) -> None:
    """Takes a test's wrapt patch off again (it may sit above ours), then uninstalls."""
    current = vars(owner)[name]
    assert current is theirs, "the test's patch was removed by someone else"
    setattr(owner, name, theirs.__wrapped__)
    assigntape.uninstall()


@pytest.mark.parametrize("place", sorted(_PLACES))
def test_a_wrapt_patch_made_after_the_first_tape_stays_through_switches_and_uninstall(place, monkeypatch):
    owner, name, call = _PLACES[place]
    monkeypatch.setattr(_versions, "IDLE_SECONDS", 0.0)
    v = tf.Variable(1.0)
    assert _hypergradient() == 36.0  # the first tape installs the patches
    calls: List[int] = []

    def counting(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(1)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(owner, name, counting)
    theirs = vars(owner)[name]
    try:
        for cycle in range(3):
            _idle()
            for _ in range(3):  # the first dormant call takes the switches off
                before = len(calls)
                call(v)
                assert len(calls) == before + 1, (cycle, "their patch was removed")
            assert vars(owner)[name] is theirs
            assert _hypergradient() == 36.0  # ours runs inside theirs
            if cycle == 1:
                _idle()
                assigntape.uninstall()
                assert vars(owner)[name] is theirs
                before = len(calls)
                call(v)
                assert len(calls) == before + 1
        assert _hypergradient() == 36.0  # installed again: ours found inside theirs, not doubled
    finally:
        _idle()
        _remove(owner, name, theirs)


def test_a_mock_patch_made_around_ours_stays_and_is_undone_by_its_own_exit(monkeypatch):
    monkeypatch.setattr(_versions, "IDLE_SECONDS", 0.0)
    v = tf.Variable(1.0)
    with AssignAwareTape():
        ours = vars(grv)["assign_variable_op"]
        assert isinstance(ours, Wrapper)  # in place while a tape is open
        patcher = mock.patch.object(grv, "assign_variable_op", wraps=ours)
        patched = patcher.start()
    try:
        for cycle in range(3):
            _idle()
            before = patched.call_count
            v.assign(2.0)
            v.assign(3.0)
            assert patched.call_count == before + 2, cycle
            assert vars(grv)["assign_variable_op"] is patched
            assert _hypergradient() == 36.0
    finally:
        patcher.stop()
    # mock put back what it found: ours, which is still ours to switch off.
    assert vars(grv)["assign_variable_op"] is ours
    assert _hypergradient() == 36.0
    _idle()
    v.assign(2.0)
    assert vars(grv)["assign_variable_op"] is ours.__wrapped__
    _idle()
    assigntape.uninstall()


def test_a_patch_made_while_ours_is_off_is_wrapped_when_a_tape_opens(monkeypatch):
    monkeypatch.setattr(_versions, "IDLE_SECONDS", 0.0)
    v = tf.Variable(1.0)
    assert _hypergradient() == 36.0
    _idle()
    v.assign(2.0)  # switches off: TensorFlow's own is in place
    original = vars(grv)["assign_variable_op"]
    assert not hasattr(original, "__wrapped__")
    with mock.patch.object(grv, "assign_variable_op", wraps=original) as patched:
        for cycle in range(3):
            before = patched.call_count
            assert _hypergradient() == 36.0, cycle  # ours around theirs while the tape is open
            assert patched.call_count == before + 1, cycle
            _idle()
            v.assign(2.0)
            assert vars(grv)["assign_variable_op"] is patched, cycle  # theirs again, ours off
    assert vars(grv)["assign_variable_op"] is original
    _idle()
    assigntape.uninstall()
    assert vars(grv)["assign_variable_op"] is original
