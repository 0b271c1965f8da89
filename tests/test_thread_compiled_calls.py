"""Another thread's write while a tape's compiled function runs (issue 36).

Eagerly, a write from thread B to a variable that thread A's open tape read or
wrote is refused (``UntrackedWriteError`` in B, nothing written). A tape opened
inside a ``tf.function`` is open only while the function is traced; its graph
runs at each call. A call of such a function holds the tape's variables for
the call (``_compiled_tapes``), so that B's write during it is refused as
eagerly, and A's gradient is the rewrite's.

A's function pauses inside the tape (a ``numpy_function`` that signals B and
waits for it): B's write lands there, between A's write and A's read, with
no timing involved.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Tuple

import numpy as np
import pytest
import tensorflow as tf

from assigntape import AssignAwareTape, UntrackedWriteError, _compiled_tapes, _registry

V0 = np.array([1.5, -0.5, 2.0])
X0 = 0.7
E = 1.25
WAIT = 120.0


def _oracle() -> Tuple[np.ndarray, float]:
    """The assignment-free rewrite of A's step: v1 = v0 * x * E, then
    y = sum(v1 * v1) * x, differentiated under a plain tape: (v1, dy/dx)."""
    x = tf.constant(X0, tf.float64)
    with tf.GradientTape() as t:
        t.watch(x)
        v1 = tf.constant(V0) * x * E
        y = tf.reduce_sum(v1 * v1) * x
    return v1.numpy(), float(t.gradient(y, x))


class _Pause:
    """A point inside A's graph where A waits for B: ``numpy_function(pause)``."""

    def __init__(self) -> None:
        self.reached, self.go_on = threading.Event(), threading.Event()
        self.fail = False

    def __call__(self) -> np.float64:
        if self.reached.is_set():
            return np.float64(0.0)  # a later call (another thread's) does not wait
        self.reached.set()
        assert self.go_on.wait(WAIT)
        if self.fail:
            raise RuntimeError("A's function fails here")
        return np.float64(0.0)

    def in_graph(self, after: Any) -> Any:
        with tf.control_dependencies([after]):
            return tf.numpy_function(self, [], tf.float64)


def _step(v: Any, x: Any, pause: _Pause, tape: str) -> Callable[[], Any]:
    """A's step: write v, pause (B acts), read v; the gradient by ``tape``:
    an AssignAwareTape, or a plain tape around one (followed beside it)."""

    def body() -> Any:
        v.assign(v * x * E)
        z = pause.in_graph(tf.reduce_sum(v))
        with tf.control_dependencies([z]):
            return tf.reduce_sum(v * v) * x + z

    def step() -> Any:
        if tape == "assign_aware":
            with AssignAwareTape() as t:
                y = body()
            return y, t.gradient(y, x)
        with tf.GradientTape() as p:
            with AssignAwareTape():
                y = body()
        return y, p.gradient(y, x)

    return step


def _outcome(call: Callable[[], Any]) -> Any:
    """``call()``'s result, or the exception it raised."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - reported to the test
        return error


def _while_paused(
    call: Callable[[], Any], pause: _Pause, act: Callable[[], Any], name: str = "thread-A"
) -> Tuple[Any, Any]:
    """Runs ``call`` in a thread (A, by default); once its graph pauses,
    ``act`` here (thread B). Returns (``call``'s result or exception,
    ``act``'s result or exception)."""
    out: Dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(a=_outcome(call)), name=name)
    thread.start()
    try:
        assert pause.reached.wait(WAIT), "A's function never reached its pause"
        b = _outcome(act)
    finally:
        pause.go_on.set()
        thread.join(WAIT)
    assert not thread.is_alive()
    return out["a"], b


def _assign(v: Any) -> Any:
    return v.assign(v * 2.0)


def _assign_add(v: Any) -> Any:
    return v.assign_add(tf.ones_like(v))


def _scatter(v: Any) -> Any:
    return v.scatter_nd_update([[0]], tf.constant([9.0], tf.float64))


def _scatter_slices(v: Any) -> Any:
    return v.scatter_add(tf.IndexedSlices(tf.constant([1.0], tf.float64), tf.constant([1])))


def _slice_assign(v: Any) -> Any:
    return v[0:2].assign(tf.constant([3.0, 4.0], tf.float64))


def _raw(v: Any) -> Any:
    return tf.raw_ops.AssignVariableOp(resource=v.handle, value=tf.zeros_like(v))


def _keras_step(v: Any) -> Any:
    import keras

    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build([v])
    return optimizer.apply_gradients([(tf.ones_like(v), v)])


def _compiled_write(v: Any) -> Any:
    return tf.function(lambda: v.assign_sub(tf.ones_like(v)))()


WRITES = [_assign, _assign_add, _scatter, _scatter_slices, _slice_assign, _raw, _keras_step, _compiled_write]


def _compiled(step: Callable[[], Any], how: str) -> Callable[[], Any]:
    if how == "function":
        return tf.function(step)
    if how == "concrete":
        return tf.function(step).get_concrete_function()  # traced now; called directly
    raise AssertionError(how)


def _expect_refused(b: Any, v: Any) -> None:
    assert isinstance(b, UntrackedWriteError), b
    message = str(b)
    assert v.name in message and "thread-A" in message and "tf.function" in message, message


def _expect_right(a: Any, v: Any) -> None:
    v1, dydx = _oracle()
    assert not isinstance(a, Exception), a
    np.testing.assert_allclose(a[1].numpy(), dydx, rtol=1e-12)
    np.testing.assert_allclose(v.numpy(), v1, rtol=1e-12)  # nothing written by B


@pytest.mark.parametrize("tape", ["assign_aware", "plain_beside"])
@pytest.mark.parametrize("how", ["function", "concrete"])
@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__.strip("_"))
def test_another_threads_write_during_the_call_is_refused(write: Any, how: str, tape: str) -> None:
    v = tf.Variable(V0, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64)
    pause = _Pause()
    call = _compiled(_step(v, x, pause, tape), how)
    a, b = _while_paused(call, pause, lambda: write(v))
    _expect_refused(b, v)
    _expect_right(a, v)
    assert not _registry._all_scopes  # the call's hold is gone


@pytest.mark.parametrize("first", ["inner", "outer"])
def test_a_jit_compiled_tape_function_called_in_another_function_holds_for_the_outer_call(first: str) -> None:
    """The tape in a ``jit_compile`` function (XLA cannot pause inside it),
    called by a plain compiled function that pauses before it: the outer
    call holds the inner tape's variables, whether the inner function was
    traced inside the outer's trace or before it."""
    v = tf.Variable(V0, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64)
    pause = _Pause()

    @tf.function(jit_compile=True)
    def inner() -> Any:
        with AssignAwareTape() as t:
            v.assign(v * x * E)
            y = tf.reduce_sum(v * v) * x
        return y, t.gradient(y, x)

    @tf.function
    def outer() -> Any:
        z = pause.in_graph(tf.constant(0.0, tf.float64))
        with tf.control_dependencies([z]):
            return inner()

    if first == "inner":
        inner.get_concrete_function()
    a, b = _while_paused(outer, pause, lambda: _assign(v))
    _expect_refused(b, v)
    _expect_right(a, v)


def test_a_thread_with_its_own_variables_is_unaffected() -> None:
    """B, in its own tape, writes its own variable, and B, outside every
    tape, writes a variable A's tape does not touch: both as without A."""
    v = tf.Variable(V0, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64)
    w = tf.Variable(3.0, dtype=tf.float64)
    u = tf.Variable(5.0, dtype=tf.float64)
    pause = _Pause()

    def b_acts() -> Any:
        u.assign(u * 2.0)
        with AssignAwareTape() as t:
            w.assign(w * w)  # w1 = w0^2
            y = w * 3.0  # dy/dw0 = 6 w0 = 18
        return t.gradient(y, w)

    a, b = _while_paused(tf.function(_step(v, x, pause, "assign_aware")), pause, b_acts)
    assert not isinstance(b, Exception), b
    assert float(b) == 18.0 and float(u) == 10.0 and float(w) == 9.0
    _expect_right(a, v)


def test_the_same_function_called_by_another_thread_meanwhile_is_refused() -> None:
    """Two threads running one tape step on shared variables at once: the
    second call writes what the first call's tape holds, refused before it runs."""
    v = tf.Variable(V0, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64)
    pause = _Pause()
    step = tf.function(_step(v, x, pause, "assign_aware"))
    step.get_concrete_function()
    a, b = _while_paused(step, pause, step)
    assert isinstance(b, UntrackedWriteError), b
    assert "v_written" in str(b) and "thread-A" in str(b)
    _expect_right(a, v)


def test_the_hold_ends_with_the_call_however_it_ends() -> None:
    """After the call returns, or fails, B writes freely; a function in
    whose graph no tape was open holds nothing (plain TensorFlow's race)."""
    v = tf.Variable(V0, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64)
    pause = _Pause()
    pause.fail = True
    step = tf.function(_step(v, x, pause, "assign_aware"))
    a, b = _while_paused(step, pause, lambda: None)
    assert isinstance(a, Exception) and not _registry._all_scopes
    v.assign(V0)  # from this thread, after the failed call: plain TensorFlow
    np.testing.assert_array_equal(v.numpy(), V0)

    plain_pause = _Pause()

    @tf.function
    def no_tape() -> Any:
        z = plain_pause.in_graph(tf.reduce_sum(v))
        with tf.control_dependencies([z]):
            return tf.reduce_sum(v) + z

    a, b = _while_paused(no_tape, plain_pause, lambda: _assign(v))
    assert not isinstance(b, Exception), b
    assert no_tape.get_concrete_function().graph not in _registry.tape_graphs


def test_a_call_made_while_another_threads_writing_function_runs_is_refused() -> None:
    """B's compiled function, called first (nothing held then), pauses
    before its write to v; A's tape function is called meanwhile. Unrefused,
    B's write would land inside A's tape and be credited to A's version
    (dy/dx 39.8125 where the rewrite gives 14.93): A's call is refused before
    it runs, and B's write lands whole."""
    v = tf.Variable(V0, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64)
    a_pause, b_pause = _Pause(), _Pause()
    step = tf.function(_step(v, x, a_pause, "assign_aware"))
    step.get_concrete_function()  # traced now: its graph holds v from its first call

    @tf.function
    def b_writes() -> Any:
        with tf.control_dependencies([b_pause.in_graph(tf.constant(0.0))]):
            v.assign(v * 2.0)

    a_done = threading.Event()
    out: Dict[str, Any] = {}

    def a_calls() -> None:
        out["a"] = _outcome(step)
        a_done.set()

    def b_running() -> Any:
        thread = threading.Thread(target=a_calls, name="thread-A")
        thread.start()
        # A is refused at once, or (unrefused) pauses inside its tape: B's write lands there.
        while not (a_done.is_set() or a_pause.reached.is_set()):
            a_done.wait(0.01)
        return thread

    _, thread = _while_paused(b_writes, b_pause, b_running, name="thread-B")
    a_pause.go_on.set()
    thread.join(WAIT)
    assert isinstance(out["a"], UntrackedWriteError), out["a"]
    assert "v_written" in str(out["a"]) and "b_writes" in str(out["a"]) and "thread-A" in str(out["a"])
    np.testing.assert_array_equal(v.numpy(), V0 * 2.0)  # B's write only
    assert not _registry._all_scopes and not _compiled_tapes._running


def test_a_function_that_writes_nothing_is_looked_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a tape's graph is noted, every eager call of a function asks
    whether it writes (``_compiled_tapes._writing``). A function that writes
    nothing is asked once: its graph is built, its answer cannot change. One
    that writes is asked at every call (its variables depend on the inputs)."""
    v = tf.Variable(V0, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64)
    step = tf.function(_step(v, x, _Pause(), "assign_aware"))
    traced = step.get_concrete_function()  # kept: its graph stays noted
    assert traced.graph in _registry.tape_graphs

    asked = []
    writing = _compiled_tapes._writing

    def counted(*args: Any) -> Any:
        asked.append(args[4])  # (call, writes_of, given, wrapped, instance, args, kwargs)
        return writing(*args)

    monkeypatch.setattr(_compiled_tapes, "_writing", counted)
    reads = tf.function(lambda: tf.reduce_sum(v) * 2.0)
    writes = tf.function(lambda: v.assign_add(tf.ones_like(v)))
    for i in range(3):
        assert float(reads()) == 2.0 * (V0.sum() + 3.0 * i)  # (v + i) summed, doubled
        writes()
    read_calls = [f for f in asked if f is reads.get_concrete_function()]
    write_calls = [f for f in asked if f is writes.get_concrete_function()]
    assert len(read_calls) == 1 and len(write_calls) == 3
    np.testing.assert_array_equal(v.numpy(), V0 + 3.0)


# ``_compiled_tapes._writes_nothing`` remembers, per concrete function, that
# it writes nothing, and its later eager calls skip the write check: B's
# function, paused in its graph before its write (or where it would write),
# runs in thread B while A's tape function (traced, noted) is called here.
# Where B's function writes a variable A's tape holds, A's call is refused
# before it runs; where it does not, A's call runs and its gradient is the
# rewrite's (``_oracle``).


class _Pauses:
    """A pause in B's graph that each call reaches anew: ``now`` is replaced
    before each call (a ``_Pause`` waits once)."""

    def __init__(self) -> None:
        self.now = _Pause()

    def __call__(self) -> np.float64:
        return self.now()

    def in_graph(self, after: Any) -> Any:
        with tf.control_dependencies([after]):
            return tf.numpy_function(self, [], tf.float64)


class _Held:
    """A's tape function, traced (its graph holds v and x), and B's pause."""

    def __init__(self) -> None:
        self.v = tf.Variable(V0, name="v_held")
        self.w = tf.Variable(V0, name="w_free")  # A's tape never touches w
        self.x = tf.Variable(X0, dtype=tf.float64)
        released = _Pause()
        released.go_on.set()  # A does not wait in its own graph
        self.step = tf.function(_step(self.v, self.x, released, "assign_aware"))
        self.step.get_concrete_function()
        self.pauses = _Pauses()

    def a_during(self, b_call: Callable[[], Any]) -> Any:
        """A's call made while ``b_call`` (in thread B) is paused: A's outcome."""
        self.v.assign(V0)
        self.pauses.now = _Pause()
        b, a = _while_paused(b_call, self.pauses.now, lambda: _outcome(self.step), name="thread-B")
        assert not isinstance(b, Exception), b
        assert not _registry._all_scopes and not _compiled_tapes._running
        return a

    def expect_refused(self, b_call: Callable[[], Any], function: str) -> None:
        a = self.a_during(b_call)
        assert isinstance(a, UntrackedWriteError), a
        assert "v_held" in str(a) and function in str(a), str(a)

    def expect_right(self, b_call: Callable[[], Any]) -> None:
        a = self.a_during(b_call)
        assert not isinstance(a, Exception), a
        np.testing.assert_allclose(a[1].numpy(), _oracle()[1], rtol=1e-12)


def _cached(function: Any, *args: Any) -> bool:
    return function.get_concrete_function(*args) in _compiled_tapes._writes_nothing


def test_a_function_reading_its_variable_argument_is_cached_for_every_variable() -> None:
    held = _Held()

    @tf.function
    def reads(var: Any) -> Any:
        with tf.control_dependencies([held.pauses.in_graph(tf.constant(0.0, tf.float64))]):
            return tf.reduce_sum(var) * 2.0

    for var in (held.w, held.v, held.w, held.v):
        held.expect_right(lambda var=var: reads(var))
        assert _cached(reads, var)
    assert len(reads._list_all_concrete_functions()) == 1  # one function for both variables


@pytest.mark.parametrize("through", ["assign", "an identity of its handle"])
def test_a_function_writing_its_argument_is_seen_writing_each_variable_passed(through: str) -> None:
    held = _Held()

    @tf.function
    def writes(var: Any) -> Any:
        with tf.control_dependencies([held.pauses.in_graph(tf.constant(0.0, tf.float64))]):
            if through == "assign":
                return var.assign(var * 2.0)
            tf.raw_ops.AssignVariableOp(resource=tf.identity(var.handle), value=var * 2.0)
            return tf.constant(0.0)

    for var in (held.w, held.v, held.w, held.v):
        if var is held.v:
            held.expect_refused(lambda var=var: writes(var), "writes")
        else:
            held.expect_right(lambda var=var: writes(var))
        assert not _cached(writes, var)


@pytest.mark.parametrize("written", ["captured", "argument"])
def test_a_function_calling_a_nested_writing_function_is_seen_writing(written: str) -> None:
    held = _Held()

    @tf.function
    def inner(var: Any) -> Any:
        target = held.v if written == "captured" else var
        return target.assign_add(tf.ones_like(target))

    @tf.function
    def outer(var: Any) -> Any:
        with tf.control_dependencies([held.pauses.in_graph(tf.constant(0.0, tf.float64))]):
            return inner(var)

    for var in (held.w, held.v):
        if written == "captured" or var is held.v:
            held.expect_refused(lambda var=var: outer(var), "outer")
        else:
            held.expect_right(lambda var=var: outer(var))
        assert not _cached(outer, var)


def test_a_retrace_that_writes_is_seen_after_one_that_writes_nothing() -> None:
    held = _Held()

    @tf.function
    def maybe(var: Any, write: bool) -> Any:
        with tf.control_dependencies([held.pauses.in_graph(tf.constant(0.0, tf.float64))]):
            return var.assign(var * 2.0) if write else tf.reduce_sum(var)

    held.expect_right(lambda: maybe(held.v, False))
    assert _cached(maybe, held.v, False)
    held.expect_refused(lambda: maybe(held.v, True), "maybe")
    assert not _cached(maybe, held.v, True)
    held.expect_right(lambda: maybe(held.v, False))


@pytest.mark.parametrize("writes", [False, True])
def test_a_function_called_in_a_tapes_trace_then_eagerly(writes: bool) -> None:
    """Traced first inside another tape's function (a writing one is traced
    inline there), then called eagerly by B: seen as it is."""
    held = _Held()

    @tf.function
    def g(var: Any) -> Any:
        with tf.control_dependencies([held.pauses.in_graph(tf.constant(0.0, tf.float64))]):
            return var.assign(var * 2.0) if writes else var * 2.0

    u = tf.Variable(V0, name="u")

    @tf.function
    def in_tape() -> Any:
        with AssignAwareTape() as t:
            y = tf.reduce_sum(g(u) * held.x)
        return t.gradient(y, held.x)

    held.pauses.now.go_on.set()  # the trace's call does not wait
    # (Rewrite: y = sum(2 u0) * x: dy/dx = 2 sum(u0).)
    np.testing.assert_allclose(float(in_tape()), 2.0 * V0.sum(), rtol=1e-12)
    if writes:
        held.expect_refused(lambda: g(held.v), "g")
    else:
        held.expect_right(lambda: g(held.v))
    assert _cached(g, held.v) is not writes


@pytest.mark.parametrize("given", ["dataset", "iterator"])
def test_a_function_given_a_writing_dataset_is_seen_writing(given: str) -> None:
    """A dataset (or iterator) argument runs its functions in the called
    function's graph, which sees only a placeholder: one concrete function
    serves every dataset of the element spec, one that writes after one
    that does not."""
    held = _Held()

    @tf.function
    def consume(ds: Any) -> Any:
        if given == "iterator":
            return next(ds)
        return ds.reduce(tf.constant(0.0, tf.float64), lambda a, e: a + e)

    def reads(i: Any) -> Any:
        with tf.control_dependencies([held.pauses.in_graph(tf.constant(0.0, tf.float64))]):
            return tf.cast(i, tf.float64) + tf.reduce_sum(held.w)

    def writes(i: Any) -> Any:
        with tf.control_dependencies([held.pauses.in_graph(tf.constant(0.0, tf.float64))]):
            with tf.control_dependencies([held.v.assign(held.v * 2.0)]):
                return tf.cast(i, tf.float64)

    def made(function: Any) -> Any:
        dataset = tf.data.Dataset.range(1).map(function)
        return iter(dataset) if given == "iterator" else dataset

    held.expect_right(lambda: consume(made(reads)))
    held.expect_refused(lambda: consume(made(writes)), "consume")
    held.expect_right(lambda: consume(made(reads)))
