"""``assigntape.testing``: finite differences through writes, gradient checks,
the public program strategy and the pytest plugin that swaps the tape in.

Expected values are worked out by hand in the comments (never taken from the
code under test), or come from a plain ``tf.GradientTape`` on a program
without writes.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import assume, given, settings

from assigntape import AssignAwareTape
from assigntape.testing import check_gradients, numerical_gradient
from assigntape.testing.strategies import programs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _f64(value, name=None):
    return tf.Variable(value, dtype=tf.float64, name=name)


def _two_writes():
    """w <- 3 w; c <- c + sum(w); loss = sum(w^2) + c.

    d loss / d w0 = 9 * 2 w0 + 3 = 18 w0 + 3, d loss / d c0 = 1; from
    w0 = [1, 2]: [21, 39] and 1. After the first write, version 1 of w:
    d loss / d w1 = 2 w1 + 1 = [7, 13] (w1 = [3, 6])."""
    w, c = _f64([1.0, 2.0], "w"), _f64(0.0, "c")

    def fn():
        w.assign(w * 3.0)
        c.assign_add(tf.reduce_sum(w))
        return tf.reduce_sum(w**2) + c

    return w, c, fn


def _assert_state(w, c):
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
    assert c.numpy() == 0.0


# -- numerical_gradient ----------------------------------------------------------------


def test_numerical_gradient_through_writes_restores_every_variable():
    w, c, fn = _two_writes()
    gw, gc = numerical_gradient(fn, [w, c])
    np.testing.assert_allclose(gw, [21.0, 39.0], rtol=1e-7)
    np.testing.assert_allclose(gc, 1.0, rtol=1e-7)
    assert gw.dtype == np.float64 and gw.shape == (2,)
    _assert_state(w, c)


def test_numerical_gradient_of_a_written_but_not_given_variable_restores_it():
    # Only w is a source; c is written by fn and must be put back too, or the
    # later evaluations would start from a drifted c (and the gradient with it).
    w, c, fn = _two_writes()
    (gw,) = numerical_gradient(fn, [w])
    np.testing.assert_allclose(gw, [21.0, 39.0], rtol=1e-7)
    _assert_state(w, c)


def test_numerical_gradient_with_a_tf_function_that_writes():
    # fn calls a tf.function that writes (an eager AssignAwareTape would refuse
    # it; finite differences need no tape). loss = sum((3 w)^2): 18 w.
    w = _f64([1.0, -2.0])
    step = tf.function(lambda: w.assign(w * 3.0))

    def fn():
        step()
        return tf.reduce_sum(w**2)

    (g,) = numerical_gradient(fn, w)
    np.testing.assert_allclose(g, [18.0, -36.0], rtol=1e-7)
    np.testing.assert_array_equal(w.numpy(), [1.0, -2.0])


def test_numerical_gradient_by_a_version():
    w, c, fn = _two_writes()
    with AssignAwareTape() as tape:
        fn()
    w.assign([1.0, 2.0]), c.assign(0.0)
    g1, gc1 = numerical_gradient(fn, [tape.versions(w)[1], tape.versions(c)[1]])
    np.testing.assert_allclose(g1, [7.0, 13.0], rtol=1e-7)
    np.testing.assert_allclose(gc1, 1.0, rtol=1e-7)
    _assert_state(w, c)


def test_numerical_gradient_of_a_version_with_a_tape_inside_fn():
    # fn opens its own AssignAwareTape (a MAML-like inner step): the value of
    # version 1 is perturbed after the inner tape noted the write too.
    # w1 = w0 - 0.1 * d(w0^2)/dw0 = 0.8 w0; loss = w1^2 + w1 * (a gradient
    # through the write, d w1^2 / d w0 = 1.6 w1): d loss / d w1 = 2 w1 + 1.6 w1 * 2.
    w = _f64(1.5)

    def fn():
        with AssignAwareTape() as inner:
            w.assign_sub(0.2 * w)
            y = w * w
        g = inner.gradient(y, w)  # d w1^2 / d w0 = 2 w1 * 0.8
        return w * w + w * g

    with AssignAwareTape() as tape:
        fn()
    w.assign(1.5)
    (g1,) = numerical_gradient(fn, tape.versions(w)[1])
    w1 = 1.2
    # loss(w1') = w1'^2 + w1' * 1.6 w1'  (the inner gradient uses the perturbed version)
    np.testing.assert_allclose(g1, 2 * w1 + 2 * 1.6 * w1, rtol=1e-6)
    assert w.numpy() == 1.5


def test_numerical_gradient_complex_and_keras_and_float32():
    import keras

    # L = Re(z)^2 + 3 Im(z): TensorFlow's gradient is dL/dRe + i dL/dIm = 2 Re(z) + 3i.
    z = tf.Variable([1.0 + 2.0j, -0.5 + 0.0j], dtype=tf.complex128)
    (gz,) = numerical_gradient(lambda: tf.reduce_sum(tf.math.real(z) ** 2 + 3.0 * tf.math.imag(z)), [z])
    np.testing.assert_allclose(gz, [2.0 + 3.0j, -1.0 + 3.0j], rtol=1e-7)
    with tf.GradientTape() as plain:  # the same convention as TensorFlow's own
        loss = tf.reduce_sum(tf.math.real(z) ** 2 + 3.0 * tf.math.imag(z))
    np.testing.assert_allclose(gz, plain.gradient(loss, z), rtol=1e-7)

    k = keras.Variable([0.5, 1.0], dtype="float32")
    (gk,) = numerical_gradient(lambda: tf.reduce_sum(tf.convert_to_tensor(k) ** 3), [k], delta=1e-2)
    assert gk.dtype == np.float32  # the variable's own dtype
    np.testing.assert_allclose(gk, [0.75, 3.0], rtol=1e-3)  # 3 k^2


def test_numerical_gradient_restores_an_optimizer_step_and_its_counter():
    import keras

    w = _f64([0.5, -1.0])
    opt = keras.optimizers.SGD(learning_rate=0.1)
    opt.build([w])
    iterations = int(opt.iterations.numpy())

    def fn():
        opt.apply_gradients([(2.0 * tf.convert_to_tensor(w), w)])  # w <- w - 0.1 * 2 w = 0.8 w
        return tf.reduce_sum(w**2)

    (g,) = numerical_gradient(fn, [w])
    np.testing.assert_allclose(g, 2 * 0.64 * np.array([0.5, -1.0]), rtol=1e-6)  # d (0.8 w)^2 / dw
    np.testing.assert_array_equal(w.numpy(), [0.5, -1.0])
    assert int(opt.iterations.numpy()) == iterations  # the integer counter is put back too


# -- check_gradients -----------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True])
def test_check_gradients_passes_and_returns_both(compiled):
    w, c, fn = _two_writes()
    analytic, numeric = check_gradients(fn, [w, c], compiled=compiled)
    np.testing.assert_allclose(analytic[0], [21.0, 39.0])
    np.testing.assert_allclose(analytic[1], 1.0)
    np.testing.assert_allclose(numeric[0], [21.0, 39.0], rtol=1e-7)
    _assert_state(w, c)


def test_check_gradients_by_versions():
    w, c, fn = _two_writes()
    with AssignAwareTape() as tape:
        fn()
    w.assign([1.0, 2.0]), c.assign(0.0)
    analytic, _ = check_gradients(fn, [tape.versions(w)[1], w])
    np.testing.assert_allclose(analytic[0], [7.0, 13.0])
    np.testing.assert_allclose(analytic[1], [21.0, 39.0])


@tf.custom_gradient
def _square_wrong_gradient(x):
    x = tf.convert_to_tensor(x)  # the value now, not the variable (read again later)
    return x * x, lambda g: g * 3.0 * x  # the true gradient is 2 x


def _wrong_gradient_case():
    w = _f64([1.0, 2.0], "wrongly_differentiated")
    u = _f64(0.5, "fine")

    def fn():
        w.assign(_square_wrong_gradient(w))
        return tf.reduce_sum(w) + u * u

    return w, u, fn


def _assert_names_the_wrong_source(message):
    assert "wrongly_differentiated" in message and "fine" not in message
    header, rule, row = message.splitlines()[-3:]
    columns = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", row)))
    # The tape says 3 w = [3, 6], the truth is 2 w = [2, 4]: the largest error,
    # 2, is at index (1,), and relative to 4 it is 0.5.
    assert columns["source"] == "wrongly_differentiated:0"
    assert float(columns["max abs error"]) == pytest.approx(2.0, rel=1e-5)
    assert float(columns["max rel error"]) == pytest.approx(0.5, rel=1e-5)
    assert columns["at index"] == "(1,)"
    assert float(columns["tape"]) == 6.0 and float(columns["numerical"]) == pytest.approx(4.0)


@pytest.mark.parametrize("compiled", [False, True])
def test_check_gradients_catches_a_wrong_gradient(compiled):
    w, u, fn = _wrong_gradient_case()
    with pytest.raises(AssertionError) as raised:
        check_gradients(fn, [w, u], compiled=compiled)
    _assert_names_the_wrong_source(str(raised.value))
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])


def test_check_gradients_of_fn_calling_a_writing_tf_function():
    # An eager tape refuses a tf.function that writes a float variable (README
    # "Semantics" 9): check_gradients passes the refusal on, state restored;
    # the finite differences alone work.
    from assigntape import UntrackedWriteError

    w, u, body = _wrong_gradient_case()
    step = tf.function(body)

    def fn():
        return step()

    with pytest.raises(UntrackedWriteError):
        check_gradients(fn, [w, u])
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
    gw, gu = numerical_gradient(fn, [w, u])
    np.testing.assert_allclose(gw, [2.0, 4.0], rtol=1e-7)  # d sum(w^2) / dw
    np.testing.assert_allclose(gu, 1.0, rtol=1e-7)  # d u^2 / du at 0.5
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])


def test_check_gradients_none_where_the_numerical_one_is_not_zero():
    a, c = _f64(2.0, "cut_off"), _f64(0.0, "c")

    def fn():
        c.assign(tf.stop_gradient(a * 2.0))  # the value depends on a, no gradient path
        return c * 1.0

    with pytest.raises(AssertionError) as raised:
        check_gradients(fn, [a])
    assert "cut_off" in str(raised.value) and "None" in str(raised.value)
    assert a.numpy() == 2.0 and c.numpy() == 0.0


def test_check_gradients_none_where_the_numerical_one_is_zero_passes():
    a, b = _f64(2.0), _f64(5.0)
    analytic, numeric = check_gradients(lambda: a * 3.0, [a, b])
    assert analytic[1] is None and numeric[1] == 0.0
    np.testing.assert_allclose(analytic[0], 3.0)


# -- what check_gradients exists to catch --------------------------------------------

_INNER_LR = 2.2e-5  # lr * |h''(w0)| = 2.2e-5 * 9 sin(1.5) = 2e-4: the dropped term's relative size


@tf.custom_gradient
def _first_order_step(x):
    """w - lr h'(w) with h(w) = sin(3 w), differentiated as if h' were a
    constant: the second-order path (-lr h''(w)) is dropped."""
    with tf.GradientTape() as inner:
        inner.watch(x)
        h = tf.sin(3.0 * x)
    return x - _INNER_LR * inner.gradient(h, x), lambda upstream: upstream


def _inner_step_case(second_order):
    """w <- w - lr h'(w), loss = exp(w): d loss / d w0 = exp(w1) (1 - lr h''(w0)),
    h''(w) = -9 sin(3 w); dropping the second-order path is off by 2e-4 relative."""
    w = _f64(0.5, "inner_step")

    def fn():
        if second_order:
            with tf.GradientTape() as inner:  # a tape inside fn, which the outer tape follows
                h = tf.sin(3.0 * w)
            w.assign(w - _INNER_LR * inner.gradient(h, w))
        else:
            w.assign(_first_order_step(tf.convert_to_tensor(w)))
        return tf.exp(w)

    return w, fn


@pytest.mark.parametrize("compiled", [False, True])
def test_check_gradients_catches_a_dropped_second_order_path(compiled):
    w, fn = _inner_step_case(second_order=False)
    with pytest.raises(AssertionError, match="inner_step"):
        check_gradients(fn, [w], compiled=compiled)
    assert w.numpy() == 0.5
    # The right program passes, and matches the hand derivation.
    w, fn = _inner_step_case(second_order=True)
    analytic, numeric = check_gradients(fn, [w], compiled=compiled)
    w1 = 0.5 - _INNER_LR * 3.0 * np.cos(1.5)
    expected = np.exp(w1) * (1.0 + _INNER_LR * 9.0 * np.sin(1.5))
    np.testing.assert_allclose(analytic[0], expected, rtol=1e-12)
    np.testing.assert_allclose(numeric[0], expected, rtol=1e-9)


@tf.custom_gradient
def _doubled_gradient(x):
    return tf.identity(x), lambda upstream: 2.0 * upstream  # the true gradient is 1


@pytest.mark.parametrize("dtype", [tf.float64, tf.float32])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e6])
def test_check_gradients_catches_a_factor_two_at_any_scale(dtype, scale):
    # loss = scale * sum(w1^2) with w1 = 3 w0: d loss / d w0 = 18 scale w0; the
    # tape says twice that. The right program (no custom gradient) passes.
    w = tf.Variable([0.5, -0.25], dtype=dtype, name="scaled")

    def fn(wrong):
        def body():
            w.assign(3.0 * (_doubled_gradient(tf.convert_to_tensor(w)) if wrong else w))
            return tf.cast(scale, dtype) * tf.reduce_sum(w * w)

        return body

    with pytest.raises(AssertionError, match="scaled"):
        check_gradients(fn(True), [w])
    analytic, _ = check_gradients(fn(False), [w])
    np.testing.assert_allclose(analytic[0], 18.0 * scale * np.array([0.5, -0.25]), rtol=1e-5)


def test_check_gradients_none_against_a_tiny_but_real_gradient_fails():
    # A loss of scale 1e-9 whose gradient the tape lost (a stop_gradient on the
    # written value): the differences measure 2e-9 a, well above their error.
    a, c = _f64(2.0, "tiny_cut"), _f64(0.0)

    def fn():
        c.assign(tf.stop_gradient(a * 1e-9))
        return c * a

    with pytest.raises(AssertionError, match="tiny_cut"):
        check_gradients(fn, [a])


_SMOOTH_WRITES = (
    "assign",
    "assign_add",
    "assign_sub",
    "scatter_update",
    "scatter_add",
    "scatter_sub",
    "scatter_mul",
    "scatter_nd_update",
    "scatter_nd_add",
    "scatter_nd_sub",
    "slice",
)


def _generated_check(program):
    from assigntape.testing._interpreter import VariableStore, interpret, state

    _, _, variables, params = state(program)
    check_gradients(lambda: interpret(program, VariableStore(variables, []), params), variables)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(programs(dtypes=["float64"], writes=_SMOOTH_WRITES, stopped_writes=False, max_steps=6))
def test_check_gradients_passes_right_programs_in_float64(program):
    # Right programs (the tape against its own rewrite is Program.check's
    # business): no false alarm from the estimated tolerances. Writes whose
    # value has kinks (min, max) or poles (div) are left out.
    _generated_check(program)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(programs(dtypes=["float32"], writes=_SMOOTH_WRITES, stopped_writes=False, max_steps=6))
def test_check_gradients_passes_right_programs_in_float32(program):
    # Not with a constant written over a small value: in float32, 1e-10 + 0.25
    # - 0.25 rounds to a staircase of step 3e-8 that the differences see as
    # flat (README "Known limits": check such code in float64).
    assume("write_const" not in program.kinds())
    _generated_check(program)


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("check", [numerical_gradient, check_gradients])
def test_bad_input(check):
    w, c, fn = _two_writes()
    with pytest.raises(TypeError, match="callable"):
        check(42, [w])
    with pytest.raises(TypeError, match="sources"):
        check(fn, [tf.constant(1.0)])
    with pytest.raises(TypeError, match="sources"):
        check(fn, ["w"])
    with pytest.raises(ValueError, match="version"):
        check(fn, [tf.Variable(1.0).handle])  # a resource tensor no tape made

    def not_scalar():
        w.assign(w * 3.0)
        c.assign(1.0)
        return w

    with pytest.raises(ValueError, match="scalar"):
        check(not_scalar, [w])
    _assert_state(w, c)

    def raises():
        w.assign(w * 3.0)
        c.assign_add(1.0)
        raise KeyError("from fn")

    with pytest.raises(KeyError, match="from fn"):
        check(raises, [w])
    _assert_state(w, c)

    calls = []

    def raises_later():
        # The probe and the first runs succeed; a later run raises.
        calls.append(1)
        w.assign(w * 3.0)
        c.assign_add(1.0)
        if len(calls) == 4:
            raise RuntimeError("later")
        return tf.reduce_sum(w) + c

    with pytest.raises(RuntimeError, match="later"):
        check(raises_later, [w])
    _assert_state(w, c)


def test_integer_source_is_refused():
    with pytest.raises(TypeError, match="int32"):
        numerical_gradient(lambda: tf.constant(1.0), [tf.Variable(1)])


# -- strategies ---------------------------------------------------------------------


def test_importing_assigntape_testing_does_not_import_hypothesis():
    code = (
        "import sys, assigntape.testing as t; assert 'hypothesis' not in sys.modules; "
        "assert 'pytest' not in sys.modules; print(sorted(t.__all__))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['check_gradients', 'numerical_gradient']"


@settings(max_examples=10)
@given(__import__("assigntape.testing.strategies", fromlist=["programs"]).programs(max_steps=5))
def test_a_program_repr_is_python_that_rebuilds_it(program):
    namespace: dict = {}
    exec(f"from assigntape.testing.strategies import Program\nprogram = {program!r}\n", namespace)
    assert namespace["program"] == program
    assert repr(namespace["program"]) == repr(program)


@settings(max_examples=3)
@given(__import__("assigntape.testing.strategies", fromlist=["programs"]).programs(max_steps=4))
def test_a_pasted_program_runs(program):
    # The strategy's example, printed, pasted and run.
    namespace: dict = {}
    exec(f"from assigntape.testing.strategies import Program\n{program!r}.check()\n", namespace)


def test_strategy_options_bound_the_programs():
    from assigntape.testing.strategies import programs

    @settings(max_examples=30)
    @given(
        programs(
            max_variables=2,
            max_steps=3,
            dtypes=("float64",),
            writes=("assign_add", "scatter_min"),
            keras_variables=False,
        )
    )
    def check(program):
        assert 1 <= len(program.shapes) <= 2
        assert set(program.dtypes) == {"float64"} and not any(program.keras)
        assert 1 <= len(program.statements) <= 3
        for stmt in program.statements:
            assert stmt[0] in ("read", "write", "write_const", "write_stopped", "partial")
            if stmt[0] != "read":
                assert stmt[2] in ("assign_add", "scatter_min")

    check()

    @settings(max_examples=30)
    @given(programs(compiled="xla", max_steps=8))
    def no_xla_missing(program):
        for stmt in program.statements:
            assert stmt[0] not in ("event", "fn_write")
            if stmt[0] == "partial":
                assert stmt[2] not in ("scatter_nd_min", "scatter_nd_max")
                assert not (stmt[2] == "slice" and stmt[8])

    no_xla_missing()


@pytest.mark.parametrize(
    "options",
    [
        dict(max_variables=0),
        dict(max_steps=1000),
        dict(dtypes=("int32",)),
        dict(writes=("scatter_pow",)),
        dict(compiled="jit"),
        dict(compiled=True, events=True),
        dict(writes=()),
    ],
)
def test_strategy_options_are_checked(options):
    from assigntape.testing.strategies import programs

    with pytest.raises(ValueError):
        programs(**options)


def _fixed_program():
    from assigntape.testing.strategies import Program

    return Program(
        shapes=((3,), ()),
        dtypes=("float64", "float32"),
        n_params=1,
        seed=3,
        statements=(
            ("write", 1, "assign_add", ("var", 0, 2), ("param", 0, 0), "mul", "tanh"),
            ("partial", 0, "scatter_add", (0, 2), ("var", 1, 0), ("param", 0, 1), "add", "sin", "scalar"),
            ("read", ("var", 0, 3), "square"),
        ),
    )


@pytest.mark.parametrize("compiled", [False, True, "xla"])
def test_program_check_passes_on_a_fixed_program(compiled):
    _fixed_program().check(compiled=compiled)


def test_program_check_fails_on_a_wrong_value(monkeypatch):
    from assigntape.testing import _interpreter

    original = _interpreter.TensorStore.write

    def wrong(self, i, kind, value, stopped):  # the rewrite now assigns where it should add
        original(self, i, "assign" if kind == "assign_add" else kind, value, stopped)

    monkeypatch.setattr(_interpreter.TensorStore, "write", wrong)
    with pytest.raises(AssertionError, match="loss"):
        _fixed_program().check()


def test_program_check_fails_on_a_none_mismatch(monkeypatch):
    from assigntape.testing import _interpreter

    write, write_part = _interpreter.TensorStore.write, _interpreter.TensorStore.write_part

    # The rewrite now loses the gradient of every written value: the
    # parameter, which reaches the loss only through writes, gets None there.
    def stopped(self, i, kind, value, stopped):
        write(self, i, kind, tf.stop_gradient(value), stopped)

    def part_stopped(self, i, kind, rows, value):
        write_part(self, i, kind, rows, tf.stop_gradient(value))

    monkeypatch.setattr(_interpreter.TensorStore, "write", stopped)
    monkeypatch.setattr(_interpreter.TensorStore, "write_part", part_stopped)
    with pytest.raises(AssertionError, match=r"gradient by params\[0\]: expected None"):
        _fixed_program().check()


def test_program_with_events_runs_eagerly_only():
    from assigntape.testing.strategies import Program

    program = Program(
        shapes=((),),
        dtypes=("float64",),
        n_params=0,
        seed=1,
        statements=(("event", "pause", False), ("write_const", 0, "assign")),
    )
    program.check()  # the pause is closed before the loss
    with pytest.raises(ValueError, match="eagerly"):
        program.check(compiled=True)


# -- the pytest plugin ----------------------------------------------------------------

_SWAP_SUITE = """
import tensorflow as tf
from tensorflow.python.eager import backprop
from assigntape import AssignAwareTape


def test_the_names_are_swapped():
    assert issubclass(tf.GradientTape, AssignAwareTape)
    assert tf.compat.v2.GradientTape is tf.GradientTape is backprop.GradientTape


def test_a_write_gradient_only_the_swapped_tape_gets_right():
    a, b, c = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0)
    with tf.GradientTape() as tape:
        c.assign(a + b)
        loss = c ** 2
    grad = tape.gradient(loss, b)  # None with a plain tf.GradientTape
    assert grad is not None and float(grad) == 6.0


def test_a_second_tape_and_a_compat_tape():
    v = tf.Variable(2.0)
    with tf.compat.v2.GradientTape() as tape:
        v.assign(v * 3.0)
        y = v * v
    assert float(tape.gradient(y, v)) == 36.0  # d (3 v)^2 / dv = 18 v
"""


def _pytest(args, cwd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_swap_tape_plugin_runs_a_suite_with_the_tape_swapped(tmp_path):
    (tmp_path / "test_swapped.py").write_text(_SWAP_SUITE)
    swapped = _pytest(["-p", "assigntape.testing.swap_tape", "test_swapped.py"], tmp_path)
    assert swapped.returncode == 0, swapped.stdout[-3000:] + swapped.stderr[-3000:]
    assert "3 passed" in swapped.stdout
    assert "swap_tape: 2 AssignAwareTape(s) swapped in" in swapped.stdout
    # Without the plugin the same suite fails: it is opt-in, and the test can fail.
    plain = _pytest(["test_swapped.py"], tmp_path)
    assert plain.returncode != 0 and "3 failed" in plain.stdout, plain.stdout[-3000:]
    assert "swap_tape" not in plain.stdout


def test_swap_tape_install_and_uninstall_in_process():
    from tensorflow.python.eager import backprop

    import assigntape
    from assigntape import _patches
    from assigntape.testing import swap_tape

    original = backprop.GradientTape
    assigntape.uninstall()  # so that the first tape below installs the patches while swapped
    _patches.follow_plain_tapes()  # as importing assigntape does
    swap_tape.install()
    try:
        assert tf.GradientTape is swap_tape.SwappedGradientTape
        before = swap_tape.swapped_count()
        # A swapped tape, with an original plain tape beside it: the plain
        # one follows versions (the patches went on the original class).
        a, c = tf.Variable(2.0), tf.Variable(0.0)
        with original() as plain, tf.GradientTape() as ours:
            c.assign(a * a)
            loss = c * 1.0
        assert float(ours.gradient(loss, a)) == 4.0 and float(plain.gradient(loss, a)) == 4.0
        assert swap_tape.swapped_count() == before + 1
        for name in ("__enter__", "__exit__", "gradient"):
            assert name not in vars(swap_tape.SwappedGradientTape)
    finally:
        swap_tape.uninstall()
    assert tf.GradientTape is original and tf.compat.v2.GradientTape is original
    assert backprop.GradientTape is original
    assert all(owner is not swap_tape.SwappedGradientTape for owner, _ in _patches.patched_places())


def test_swap_tape_runs_the_conformance_suite():
    done = _pytest(["-p", "assigntape.testing.swap_tape", "tests/test_conformance.py"], ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" in done.stdout and "failed" not in done.stdout
    count = int(done.stdout.split("swap_tape: ")[1].split()[0])
    assert count > 0


_TF_KERAS_SUITE = """
import tensorflow as tf
import tf_keras  # imported during the session: its modules take the swapped class by name
from assigntape import AssignAwareTape


def test_swapped_for_tf_keras_too():
    assert issubclass(tf.compat.v1.GradientTape, AssignAwareTape)
    assert issubclass(tf.compat.v2.GradientTape, AssignAwareTape)
"""

_AFTER_PYTEST_MAIN = r"""
import sys
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import backprop

original = backprop.GradientTape
code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "assigntape.testing.swap_tape", sys.argv[1]])
assert code == 0, code
from assigntape.testing import swap_tape

held = [(getattr(m, "__name__", m), a) for m in list(sys.modules.values()) if m is not None
        and m is not swap_tape for a, v in list(vars(m).items()) if v is swap_tape.SwappedGradientTape]
assert not held, held
assert tf.compat.v1.GradientTape is original and tf.compat.v2.GradientTape is original
assert tf.GradientTape is original and backprop.GradientTape is original
import tf_keras

before = swap_tape.swapped_count()
model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))])
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=1, verbose=0)
assert swap_tape.swapped_count() == before, (before, swap_tape.swapped_count())
print("RESTORED")
"""


def _python(script, args, cwd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


def test_swap_tape_puts_back_every_alias_after_pytest_main_in_process(tmp_path):
    # tf.compat.v1 / v2 are loaded lazily (after install, when tf_keras is
    # imported), copying the swapped class; tf_keras' training_eager_v1 takes it
    # by name. After the session no module may hold it, and tf_keras' fit
    # makes plain tapes again.
    (tmp_path / "test_tf_keras_swapped.py").write_text(_TF_KERAS_SUITE)
    done = _python(_AFTER_PYTEST_MAIN, ["test_tf_keras_swapped.py"], tmp_path)
    assert done.returncode == 0 and "RESTORED" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_swap_tape_uninstall_puts_back_aliases_made_while_swapped():
    import types

    from assigntape.testing import swap_tape

    late = types.ModuleType("assigntape_test_late_module")
    sys.modules[late.__name__] = late
    swap_tape.install()
    try:
        late.GradientTape = tf.GradientTape  # as `from tensorflow import GradientTape` would
        late.Tape = tf.compat.v1.GradientTape
        assert late.GradientTape is swap_tape.SwappedGradientTape
    finally:
        swap_tape.uninstall()
        del sys.modules[late.__name__]
    assert late.GradientTape is swap_tape._ORIGINAL and late.Tape is swap_tape._ORIGINAL


_COMPILED_BATCH_NORM_SUITE = """
import numpy as np
import keras
import tensorflow as tf
from assigntape.testing.swap_tape import _ORIGINAL


def test_an_eager_tape_around_a_compiled_batch_norm_model():
    # A correct suite: the compiled call updates BatchNorm's moving statistics
    # (not trainable, not differentiated). The gradient must be the plain tape's.
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.BatchNormalization()])
    call = tf.function(lambda x: model(x, training=True))
    x = tf.constant(np.arange(12.0).reshape(4, 3) / 7.0, tf.float32)
    weights = [w.value for w in model.trainable_weights]
    with _ORIGINAL() as plain:
        expected = plain.gradient(tf.reduce_sum(call(x) ** 3), weights)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(call(x) ** 3)
    got = tape.gradient(loss, weights)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)
"""


def test_swap_tape_untracked_writes_option(tmp_path):
    (tmp_path / "test_batch_norm.py").write_text(_COMPILED_BATCH_NORM_SUITE)
    plugin = ["-p", "assigntape.testing.swap_tape", "-W", "ignore::UserWarning", "test_batch_norm.py"]
    refused = _pytest(plugin, tmp_path)  # the default: the function's write is refused
    assert refused.returncode == 1 and "UntrackedWriteError" in refused.stdout, refused.stdout[-3000:]
    cut = _pytest(["--assigntape-untracked-writes=cut", *plugin], tmp_path)
    assert cut.returncode == 0 and "1 passed" in cut.stdout, cut.stdout[-3000:] + cut.stderr[-3000:]
    (tmp_path / "pytest.ini").write_text("[pytest]\nassigntape_untracked_writes = cut\n")
    ini = _pytest(plugin, tmp_path)
    assert ini.returncode == 0 and "1 passed" in ini.stdout, ini.stdout[-3000:] + ini.stderr[-3000:]
    # The command line wins over the ini file; a bad ini value is a usage error.
    overridden = _pytest(["--assigntape-untracked-writes=raise", *plugin], tmp_path)
    assert overridden.returncode == 1 and "UntrackedWriteError" in overridden.stdout
    (tmp_path / "pytest.ini").write_text("[pytest]\nassigntape_untracked_writes = sometimes\n")
    bad = _pytest(plugin, tmp_path)
    assert bad.returncode == 4 and "assigntape_untracked_writes" in bad.stderr, bad.stdout[-2000:] + bad.stderr[-2000:]
