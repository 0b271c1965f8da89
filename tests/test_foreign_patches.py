"""Patches other libraries make on the functions assigntape patches.

The dormant switches (``_registry.switches``) and ``uninstall()`` put back
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
from assigntape import AssignAwareTape, _registry
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
    a, v = _VARIABLES
    with AssignAwareTape() as tape:
        v.assign(a * 3.0)
        v.assign_add(a * 0.0)  # through assign_add_variable_op too
        y = v * v
    return float(tape.gradient(y, a))


_VARIABLES = (tf.Variable(2.0), tf.Variable(1.0))


def _idle() -> None:
    """Lets every closed tape go, so that the next dormant call takes the switches off."""
    gc.collect()


def _remove(owner: Any, name: str, theirs: Any) -> None:
    """Takes a test's wrapt patch off again (it may sit above ours), then uninstalls."""
    current = vars(owner)[name]
    assert current is theirs, "the test's patch was removed by someone else"
    setattr(owner, name, theirs.__wrapped__)
    assigntape.uninstall()


def _counter(calls: List[int]) -> Callable[..., Any]:
    """A wrapt wrapper that counts its calls into ``calls``."""

    def counting(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append(1)
        return wrapped(*args, **kwargs)

    return counting


def _counted_within(owner: Any, name: str, calls: List[int], count: Callable[[], List[int]]) -> List[int]:
    """``count()`` with ``owner.name`` wrapped by a counter (or, for a
    variable ``owner``, overridden on the instance), then put back."""
    if isinstance(owner, tf.Variable):
        own = getattr(owner, name)

        def override(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return own(*args, **kwargs)

        setattr(owner, name, override)
        try:
            return count()
        finally:
            delattr(owner, name)
    found = vars(owner)[name]
    wrapt.wrap_function_wrapper(owner, name, _counter(calls))
    try:
        return count()
    finally:
        setattr(owner, name, found)


@pytest.mark.parametrize("place", sorted(_PLACES))
def test_a_wrapt_patch_made_after_the_first_tape_stays_through_switches_and_uninstall(place, monkeypatch):
    owner, name, call = _PLACES[place]
    monkeypatch.setattr(_registry, "IDLE_SECONDS", 0.0)
    v = tf.Variable(1.0)
    assert _hypergradient() == 36.0  # the first tape installs the patches
    calls: List[int] = []
    wrapt.wrap_function_wrapper(owner, name, _counter(calls))
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
    monkeypatch.setattr(_registry, "IDLE_SECONDS", 0.0)
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
    monkeypatch.setattr(_registry, "IDLE_SECONDS", 0.0)
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


# Reads by the paths that end in ``ResourceVariable._read_variable_op``:
# ``value()``, an operator, conversion, ``read_value()``.
_READS = {
    "value": lambda v: v.value(),
    "operator": lambda v: v * 1.0,
    "convert_to_tensor": lambda v: tf.convert_to_tensor(v),
    "read_value": lambda v: v.read_value(),
}


def _counted_reads(read: Callable[[tf.Variable], Any], v: tf.Variable, calls: List[int]) -> List[int]:
    """How many calls one read makes of the wrapper counting into ``calls``:
    outside every tape, then inside one (after a write: a version is read)."""
    counts = []
    before = len(calls)
    read(v)
    counts.append(len(calls) - before)
    a = _VARIABLES[0]
    with AssignAwareTape() as tape:
        v.assign(a * 3.0)
        before = len(calls)
        y = read(v)
        counts.append(len(calls) - before)
        y = y * y
    # d/da (3a)^2 = 18a = 36 at a = 2: the read through their wrapper is still a version.
    assert float(tape.gradient(y, a)) == 36.0
    return counts


@pytest.mark.parametrize("read", sorted(_READS))
@pytest.mark.parametrize("where", ["class", "generated op", "instance", "variable_accessed"])
def test_a_read_inside_a_tape_calls_what_tensorflow_would_call(where, read):
    """Inside a tape, a read calls a wrapper of ``_read_variable_op`` (on
    the class or the variable) or of the generated op as often as outside:
    the short path is taken only where nothing was put in the way."""
    from tensorflow.python.ops import resource_variable_ops as rvo

    v = tf.Variable(1.0)
    calls: List[int] = []
    owner, name = {
        "instance": (v, "_read_variable_op"),
        "class": (rvo.BaseResourceVariable, "_read_variable_op"),
        "generated op": (grv, "read_variable_op"),
        "variable_accessed": (rvo, "variable_accessed"),
    }[where]
    counts = _counted_within(owner, name, calls, lambda: _counted_reads(_READS[read], v, calls))
    assert counts[0] >= 1 and counts[1] == counts[0], counts


def test_a_read_wrapper_made_before_assigntape_is_imported_is_called_inside_a_tape():
    import subprocess
    import sys

    code = """
import wrapt
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops as rvo
calls = []
def counting(wrapped, instance, args, kwargs):
    calls.append(1)
    return wrapped(*args, **kwargs)
wrapt.wrap_function_wrapper(rvo.BaseResourceVariable, "_read_variable_op", counting)
import assigntape
a, v = tf.Variable(2.0), tf.Variable(1.0)
v * 1.0
outside = len(calls)
with assigntape.AssignAwareTape() as tape:
    v.assign(a * 3.0)
    before = len(calls)
    y = v * 1.0
    inside = len(calls) - before
    y = y * y
print(outside, inside, float(tape.gradient(y, a)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["1", "1", "36.0"]  # d/da (3a)^2 = 18a


@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
@pytest.mark.parametrize("where", ["_lazy_read", "instance _lazy_read", "variable_accessed", "generated op"])
def test_a_write_method_inside_a_tape_calls_what_tensorflow_would_call(where, method):
    """As for reads: a write method's short path skips nothing someone put
    in TensorFlow's method's way (what it returns is read lazily)."""
    from tensorflow.python.ops import resource_variable_ops as rvo

    a, v = _VARIABLES[0], tf.Variable(1.0)
    calls: List[int] = []

    def counts() -> List[int]:
        found = []
        before = len(calls)
        getattr(v, method)(1.0)
        found.append(len(calls) - before)
        v.assign(1.0)
        with AssignAwareTape() as tape:
            x = a * 3.0
            before = len(calls)
            getattr(v, method)(x)
            found.append(len(calls) - before)
            y = v * v
        # v = 3a (assign), 1 + 3a (assign_add), 1 - 3a (assign_sub); dy/da = 2 v * dv/da.
        sign = -1.0 if method == "assign_sub" else 1.0
        assert float(tape.gradient(y, a)) == pytest.approx(2.0 * float(v) * 3.0 * sign)
        return found

    owner, name = {
        "instance _lazy_read": (v, "_lazy_read"),
        "_lazy_read": (rvo.BaseResourceVariable, "_lazy_read"),
        "variable_accessed": (rvo, "variable_accessed"),
        "generated op": (grv, {"assign": "assign_variable_op"}.get(method, f"{method}_variable_op")),
    }[where]
    got = _counted_within(owner, name, calls, counts)
    assert got[0] >= 1 and got[1] == got[0], got
