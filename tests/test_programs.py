"""Random programs of reads, writes and ops over variables, against the rewrite.

The programs come from the public strategy ``assigntape.testing.strategies.programs``:
straight-line programs over a few variables of several shapes and dtypes
(float32, float64, complex128), some of them Keras 3 variables; reads by
several paths (the C++ fast path, ``read_value``, Python operators,
``tf.gather``, and ``tf.function``s one and two calls deep), elementwise and
matmul ops, ``assign`` / ``assign_add`` / ``assign_sub`` (some with constants,
some under ``stop_recording``), and partial writes of every kind: scatter
update/add/sub/mul/div/min/max, scatter_nd update/add/sub/min/max and slice
assignment, some with values that broadcast (a scalar, a row). ``Program.check``
runs each program twice, through one interpreter (``assigntape.testing._interpreter``):

* on ``tf.Variable``s under ``AssignAwareTape``;
* on tensors rebound by every write, under a plain ``tf.GradientTape`` (the
  oracle), where a write under ``stop_recording`` is ``tf.stop_gradient`` of
  the new value;

and compares the loss, the final values and the gradients (and which are None).

Variants here: compiled (``tf.function``, and XLA); every write inside graph
control flow (``ControlFlowStore``); second order (the gradient of a
first-order gradient); infinite upstream gradients; tape events in the middle
of a program (an inner tape opened, the tape exited and entered again,
``reset()``); eager writes inside a ``tf.function`` with
``untracked_writes="cut"``; variables as targets; statements split into
``checkpointed`` segments (eager and compiled), and the program as the step
of ``unroll``. Where no write is under
``stop_recording`` or cut (which deliberately differ from the math), a
directional finite difference of the rewrite in float64 / complex128 must
agree with the gradients too.
"""

from __future__ import annotations

import os
from typing import Any, List, Sequence

import numpy as np
import tensorflow as tf
from hypothesis import example, given, note, settings
from hypothesis import strategies as st
from oracle import assert_grads_close, central_difference, to_numpy

from assigntape import AssignAwareTape
from assigntape.testing._interpreter import (
    ControlFlowStore,
    TensorStore,
    VariableStore,
    interpret,
    oracle_dtype,
    rewrite_run,
    state,
)
from assigntape.testing._program import compare, tolerances
from assigntape.testing._vocabulary import LAYERS, REAL
from assigntape.testing.strategies import Program, programs

# The CI profile's budgets below; the thorough profile runs ten times as many.
_SCALE = 10 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 1


def _n(examples: int) -> int:
    return examples * _SCALE


def _directions(rng, point_like: Sequence[Any]) -> List[np.ndarray]:
    out = []
    for p in point_like:
        d = rng.normal(size=np.shape(p))
        if np.iscomplexobj(p):
            d = d + 1j * rng.normal(size=np.shape(p))
        out.append(d)
    return out


def _check_finite_differences(program, grads):
    assert program.exact
    vars0, params0 = program.initial_values()
    point = [np.asarray(v) for v in vars0] + [np.asarray(p, np.float64) for p in params0]
    direction = _directions(np.random.default_rng(program.seed + 1), point)

    def f(x: Sequence[np.ndarray]) -> float:
        n = len(vars0)
        loss, _, _ = rewrite_run(program, True, list(x[:n]), list(x[n:]))
        return float(loss)

    flat = list(grads["vars"]) + list(grads["params"])
    # TensorFlow's gradient of a real loss by a complex z is dL/dRe z + i dL/dIm z,
    # so the directional derivative along d is Re(conj(g) d).
    analytic = sum(
        0.0 if g is None else float(np.sum(np.real(np.conj(to_numpy(g).astype(np.complex128)) * d)))
        for g, d in zip(flat, direction)
    )
    # A central difference's error grows with the loss's third derivative, which
    # chained complex sines make huge (the sine of a value with a large
    # imaginary part): there eps=1e-6 is too coarse and smaller steps converge
    # on the gradient. The first step that agrees passes; a wrong gradient
    # agrees with none of them (in float64 the smallest step's rounding error
    # is still far below the tolerance for these losses).
    found = []
    for eps in (1e-6, 1e-7, 1e-8):
        fd = central_difference(f, point, direction, eps=eps)
        if np.isclose(analytic, fd, rtol=2e-3, atol=2e-3):
            return
        found.append(fd)
    # No step agrees. A difference judges where it has converged (two
    # successive steps agree), and a wrong gradient disagrees with it. Where
    # none has (found by the thorough profile: three chained complex sines,
    # a gradient of 1e63, differences of 8.5e7 and others), the differences
    # cannot judge, and the rewrite, compared above, is the oracle.
    converged = [b for a, b in zip(found, found[1:]) if np.isclose(a, b, rtol=2e-3, atol=2e-3)]
    if converged:
        np.testing.assert_allclose(analytic, converged[0], rtol=2e-3, atol=2e-3)
    else:
        note(f"finite differences did not converge: {found}")


@given(programs())
# Found by the thorough profile: the gradient is right (finite differences
# converge on it as the step shrinks), but eps=1e-6 alone was 7% off.
@example(
    program=Program(
        shapes=((3,),),
        dtypes=("complex128",),
        n_params=0,
        statements=(
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "add", "sin"),
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "mul", "sin"),
        ),
        seed=0,
        keras=(False,),
    )
)
# Found by the thorough profile: a gradient of 1e63, where finite
# differences do not converge (the rewrite agrees with the tape).
@example(
    program=Program(
        shapes=((3,),),
        dtypes=("complex128",),
        n_params=0,
        statements=(
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "add", "sin"),
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "add", "sin"),
            ("read", ("var", 0, 0), "sin"),
        ),
        seed=0,
        keras=(False,),
    )
)
def test_random_programs_eager(program):
    _, grads = compare(program)  # Program.check(), keeping the gradients
    if program.exact:
        _check_finite_differences(program, grads)


@settings(max_examples=_n(60))
@given(programs())
def test_random_programs_eager_through_tensorflows_methods(program):
    """The same check with the eager short paths of the variable methods off
    (``_short_paths``): the op wrappers alone give the rewrite's answer too."""
    from assigntape import _short_paths

    _short_paths.enabled = False
    try:
        compare(program)
    finally:
        _short_paths.enabled = True


@settings(max_examples=_n(25))
@given(st.sampled_from([True, "xla"]).flatmap(lambda mode: st.tuples(programs(compiled=mode), st.just(mode))))
def test_random_programs_compiled(program_and_mode):
    program, mode = program_and_mode
    program.check(compiled=mode)


@settings(max_examples=_n(40))
@given(programs(function_writes=True))
def test_random_programs_with_writes_in_functions_cut(program):
    program.check()


@settings(max_examples=_n(25))
@given(
    st.sampled_from([True, "xla"]).flatmap(
        lambda mode: st.tuples(programs(compiled=mode, function_writes=True), st.just(mode))
    )
)
def test_random_programs_with_writes_in_functions_called_in_the_tapes_function(program_and_mode):
    """Compiled, a write in a tf.function (one or two calls deep) called in
    the tape's function is followed, as the rewrite's plain write."""
    program, mode = program_and_mode
    program.check(compiled=mode)


def test_the_generator_makes_compiled_programs_with_writes_in_functions():
    found = set()

    @settings(max_examples=30, database=None)
    @given(programs(compiled=True, function_writes=True))
    def collect(program):
        found.update(program.kinds())

    collect()
    assert "fn_write_inline" in found and "fn_write" not in found


def _none_as_zeros(grads, like):
    return [np.zeros(np.shape(ref)) if g is None else to_numpy(g) for g, ref in zip(grads, like)]


@settings(max_examples=_n(25))
@given(programs(), st.sampled_from(LAYERS))
def test_random_programs_with_every_write_in_control_flow(program, layers):
    vars0, params0, variables, params = state(program)

    @tf.function
    def body(pred, one):
        with AssignAwareTape() as tape:
            tape.watch(params)
            loss = interpret(program, ControlFlowStore(variables, [tape], pred, one, layers), params)
        return loss, tape.gradient(loss, {"vars": variables, "params": tuple(params)})

    loss, grads = body(tf.constant(True), tf.constant(1))
    expected_loss, expected, _ = rewrite_run(program)
    rtol, atol = tolerances(program)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=rtol, atol=atol)
    # The branch not taken reads the variables it leaves alone, and a loop
    # carries them, so where the rewrite has no gradient a graph gives zeros
    # (as tf.cond and tf.while_loop do).
    for key, like in (("vars", vars0), ("params", params0)):
        for got, want in zip(_none_as_zeros(grads[key], like), _none_as_zeros(expected[key], like)):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# -- second order ----------------------------------------------------------------


def _probe(program, grads):
    """A real scalar from first-order gradients: sum Re(g * r), fixed r."""
    rng = np.random.default_rng(program.seed + 2)
    flat = list(grads["vars"]) + list(grads["params"])
    terms = []
    for g in flat:
        if g is None:
            continue
        g = tf.convert_to_tensor(g)
        r = rng.normal(size=g.shape.as_list())
        if g.dtype.is_complex:
            r = r + 1j * rng.normal(size=g.shape.as_list())
        dtype = oracle_dtype(g.dtype)
        terms.append(tf.math.real(tf.reduce_sum(tf.cast(g, dtype) * tf.constant(r, dtype))))
    return tf.add_n(terms) if terms else None


def _second_order_tape(program, compiled):
    vars0, params0, variables, params = state(program)

    def body():
        with AssignAwareTape() as outer:
            outer.watch(params)
            with AssignAwareTape() as inner:
                inner.watch(params)
                loss = interpret(program, VariableStore(variables, [outer, inner]), params)
            z = _probe(program, inner.gradient(loss, {"vars": variables, "params": tuple(params)}))
        if z is None:
            return None
        return outer.gradient(z, {"vars": variables, "params": tuple(params)})

    return tf.function(body)() if compiled else body()


def _second_order_rewrite(program):
    vars0, params0 = program.initial_values()
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.tf_dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]
    with tf.GradientTape() as outer:
        outer.watch(tensors + params)
        with tf.GradientTape() as inner:
            inner.watch(tensors + params)
            loss = interpret(program, TensorStore(tensors), params)
        z = _probe(program, inner.gradient(loss, {"vars": tensors, "params": tuple(params)}))
    return None if z is None else outer.gradient(z, {"vars": tensors, "params": tuple(params)})


@settings(max_examples=_n(60))
@given(programs(max_steps=6), st.booleans())
def test_random_programs_second_order(program, compiled):
    try:
        expected = _second_order_rewrite(program)
    except TypeError as e:
        # TensorFlow's own second derivative can fail: a gather's gradient is
        # IndexedSlices, which e.g. the gradient of TanhGrad (or, in TF 2.16,
        # a product with a float) does not accept. The tape either fails the
        # same way or, where its own ops avoid TensorFlow's failing path,
        # answers the same eagerly and compiled.
        assert "IndexedSlices" in str(e)
        try:
            got = _second_order_tape(program, compiled)
        except TypeError as mine:
            assert "IndexedSlices" in str(mine)
            return
        other = _second_order_tape(program, not compiled)
        rtol, atol = tolerances(program)
        assert (got is None) == (other is None)
        if got is not None:
            assert_grads_close(got, other, rtol=rtol * 10, atol=atol * 10)
        return
    got = _second_order_tape(program, compiled)
    assert (got is None) == (expected is None)
    if expected is not None:
        rtol, atol = tolerances(program)
        assert_grads_close(got, expected, rtol=rtol * 10, atol=atol * 10)


# -- infinite upstream gradients -----------------------------------------------


@settings(max_examples=_n(60))
@given(programs(dtypes=REAL))
def test_random_programs_with_an_infinite_upstream_gradient(program):
    # One element of the first variable's final value is weighed by inf: the
    # gradient is inf or NaN wherever the rewrite's is, and equal elsewhere.
    # (Real dtypes only: with complex numbers, inf times anything but a real
    # number is NaN, so two orders of the same complex products differ.)
    vars0, params0, variables, params = state(program)
    weight = np.ones(program.shapes[0])
    weight.flat[0] = np.inf

    def loss_of(store, params):
        base = interpret(program, store, params)
        final = tf.convert_to_tensor(store.final(0))
        part = tf.math.real(final) if final.dtype.is_complex else final
        return base + tf.reduce_sum(tf.constant(weight, tf.float64) * tf.cast(part, tf.float64))

    with AssignAwareTape() as tape:
        tape.watch(params)
        loss = loss_of(VariableStore(variables, [tape]), params)
    got = tape.gradient(loss, {"vars": variables, "params": tuple(params)})
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.tf_dtypes)]
    with tf.GradientTape() as oracle:
        oracle.watch(tensors + params)
        expected_loss = loss_of(TensorStore(tensors), params)
    expected = oracle.gradient(expected_loss, {"vars": tensors, "params": tuple(params)})
    rtol, atol = tolerances(program)
    for a, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
        assert (a is None) == (e is None)
        if e is not None:
            np.testing.assert_allclose(to_numpy(a), to_numpy(e), rtol=rtol, atol=atol, equal_nan=True)


# -- tape events in the middle of a program ---------------------------------------


@settings(max_examples=_n(80))
@given(programs(events=True))
# Found by the thorough profile: written while the tape was paused, then read
# through a tf.function (its capture, not v.handle) once the tape resumed.
@example(
    program=Program(
        shapes=((), (), (), ()),
        dtypes=("float32", "float32", "float32", "complex128"),
        n_params=0,
        statements=(
            ("event", "pause", False),
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "add", "half"),
            ("event", "resume", False),
            ("read", ("var", 0, 4), "half"),
        ),
        seed=0,
        keras=(True, True, True, False),
    )
)
# The same write, then reset(): the write now comes before the tape's start, so
# the variable's first read after it reaches the new start version; it is not
# cut as a write made while the tape was closed.
@example(
    program=Program(
        shapes=((), ()),
        dtypes=("float32", "float64"),
        n_params=0,
        statements=(
            ("event", "pause", False),
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "add", "half"),
            ("event", "resume", False),
            ("event", "reset", False),
            ("read", ("var", 0, 0), "half"),
        ),
        seed=0,
        keras=(True, False),
    )
)
# A write made while the tape was paused, not read before the tape is paused
# again: it stays a write with no gradient path (the second exit forgot it).
@example(
    program=Program(
        shapes=((), ()),
        dtypes=("float32", "complex128"),
        n_params=0,
        statements=(
            ("event", "pause", False),
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "add", "half"),
            ("read", ("var", 0, 0), "half"),
            ("event", "resume", False),
            ("event", "pause", False),
            ("event", "resume", False),
        ),
        seed=0,
        keras=(True, False),
    )
)
def test_random_programs_with_tape_events(program):
    # The strategy enters a paused tape again before the loss; Program.check
    # compares the outer tape's gradients, and the inner tape's if one opened.
    program.check()


# Tape events and writes in tf.functions together: every program generated is
# one whose own check() runs (its tapes, the inner one of ours too, cut the
# functions' writes); none is refused with UntrackedWriteError.
@settings(max_examples=_n(60))
@given(programs(events=True, function_writes=True))
# Reported (issue 36): a write in a tf.function, then the tape paused.
@example(
    program=Program(
        shapes=((),),
        dtypes=("float64",),
        n_params=2,
        seed=367,
        keras=(False,),
        statements=(
            ("fn_write", 0, "assign_add", ("param", 0, 2), ("var", 0, 1), "add", "square"),
            ("write", 0, "assign", ("var", 0, 5), ("param", 1, 0), "mul", "tanh"),
            ("event", "pause", False),
            ("write_const", 0, "assign_sub"),
            ("event", "resume", False),
        ),
    )
)
# An inner tape of ours open when a tf.function writes.
@example(
    program=Program(
        shapes=((3,),),
        dtypes=("float32",),
        n_params=1,
        seed=5,
        keras=(False,),
        statements=(
            ("event", "inner", True),
            ("fn_write", 0, "assign", ("param", 0, 0), ("var", 0, 0), "mul", "sin"),
            ("read", ("var", 0, 4), "square"),
        ),
    )
)
# Found by the thorough profile: the tape exited and entered again, a write
# in a tf.data map (cut), then a read through a tf.function made after it,
# which made the version from before the write current again.
@example(
    program=Program(
        shapes=((), (), ()),
        dtypes=("float32", "float32", "complex128"),
        n_params=1,
        seed=0,
        keras=(True, True, False),
        statements=(
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "add", "half"),
            ("event", "pause", False),
            ("event", "resume", False),
            ("fn_write", 0, "assign", ("var", 1, 0), ("param", 0, 0), "add", "half"),
            ("read", ("var", 0, 0), "half"),
            ("read", ("var", 0, 4), "half"),
        ),
    )
)
def test_random_programs_with_tape_events_and_writes_in_functions(program):
    program.check()


def test_the_generator_combines_tape_events_and_writes_in_functions():
    # The combination is generated, not filtered out.
    from hypothesis import find

    found = find(
        programs(events=True, function_writes=True),
        lambda p: "event" in p.kinds() and "fn_write" in p.kinds(),
        settings=settings(database=None, max_examples=500),
    )
    assert "event" in found.kinds() and "fn_write" in found.kinds()


def test_the_generator_makes_programs_that_need_the_tape():
    # A fixed program with a chain of writes: the plain tape loses the gradient
    # that the rewrite and the AssignAwareTape both find.
    program = Program(
        shapes=((3,), (3,)),
        dtypes=(tf.float32, tf.float64),
        n_params=1,
        statements=(
            ("write", 1, "assign", ("var", 0, 0), ("param", 0, 0), "mul", "tanh"),
            ("write", 0, "assign_sub", ("var", 1, 2), ("var", 0, 1), "add", "sin"),
            ("read", ("var", 0, 3), "square"),
        ),
        seed=11,
    )
    _, grads = compare(program)
    _check_finite_differences(program, grads)
    assert grads["params"][0] is not None and abs(float(grads["params"][0])) > 1e-3
    # The plain tape, on the same program, has no gradient for the parameter.
    vars0, params0, variables, params = state(program)
    with tf.GradientTape() as plain:
        plain.watch(params)
        loss = interpret(program, VariableStore(variables, [plain]), params)
    assert plain.gradient(loss, params[0]) is None


@settings(max_examples=_n(40))
@given(programs(), st.booleans())
# Found by the thorough profile: a scalar scatter_mul update from a variable
# written before, compiled.
@example(
    program=Program(
        shapes=((), (3,), ()),
        dtypes=("float32", "complex128", "complex128"),
        n_params=0,
        statements=(
            ("read", ("var", 0, 0), "half"),
            ("write", 0, "assign", ("var", 0, 0), ("var", 0, 0), "add", "half"),
            ("read", ("var", 1, 0), "half"),
            ("partial", 1, "scatter_mul", (0,), ("var", 0, 0), ("var", 0, 0), "add", "half", "scalar"),
        ),
        seed=0,
        keras=(True, False, False),
    ),
    compiled=True,
)
def test_random_programs_variable_targets(program, compiled):
    # Each variable (Keras 3 ones included) as a target means its latest version.
    vars0, params0, variables, params = state(program)

    def body():
        with AssignAwareTape(persistent=True) as tape:
            tape.watch(params)
            interpret(program, VariableStore(variables, [tape]), params)
        return [tape.gradient(v, {"vars": variables, "params": tuple(params)}) for v in variables]

    got = tf.function(body)() if compiled else body()
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.tf_dtypes)]
    with tf.GradientTape(persistent=True) as oracle:
        oracle.watch(tensors + params)
        store = TensorStore(tensors)
        interpret(program, store, params)
    rtol, atol = tolerances(program)
    for i, grads in enumerate(got):
        expected = oracle.gradient(store.final(i), {"vars": tensors, "params": tuple(params)})
        assert_grads_close(grads, expected, rtol=rtol, atol=atol)


# The loop XLA differentiates in the same function: a loop in a cond branch
# does not compile (a known limit), a tf.while_loop needs maximum_iterations
# (struct_loop has none).
_XLA_LOOP_LAYERS = [layers for layers in LAYERS if layers[0] == "loop"]


@settings(max_examples=_n(12))
@given(programs(compiled="xla"), st.sampled_from(_XLA_LOOP_LAYERS), st.sampled_from(["tf.gradients", "inner_tape"]))
def test_random_programs_with_every_write_in_a_loop_differentiated_inside_xla(program, layers, way):
    """Every write in a graph loop, the gradient taken inside the compiled
    function while a persistent tape (``tf.gradients``) or an outer tape
    records: TensorFlow then wraps the loop in a call that the gradient
    rewrites, whose writes XLA must still order (``_branch_writes.written_again``)."""
    vars0, params0, variables, params = state(program)

    @tf.function(jit_compile=True)
    def body(pred, one, *params):
        params = list(params)  # placeholders of this graph, for tf.gradients
        if way == "tf.gradients":
            with AssignAwareTape(persistent=True) as tape:
                tape.watch(params)
                loss = interpret(program, ControlFlowStore(variables, [tape], pred, one, layers), params)
                # tf.gradients through the loop, in the tape: its gradient is built in the same graph.
                inner_params = tf.gradients(loss, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return loss, tape.gradient(loss, {"vars": variables, "params": tuple(params)}), inner_params
        with AssignAwareTape() as outer:
            outer.watch(params)
            with AssignAwareTape() as inner:
                inner.watch(params)
                loss = interpret(program, ControlFlowStore(variables, [outer, inner], pred, one, layers), params)
            grads = inner.gradient(loss, {"vars": variables, "params": tuple(params)})
        return loss, grads, list(grads["params"])

    loss, grads, in_graph = body(tf.constant(True), tf.constant(1), *params)
    expected_loss, expected, finals = rewrite_run(program)
    rtol, atol = tolerances(program)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=rtol, atol=atol)
    for got, want in zip([v.numpy() for v in variables], finals):
        np.testing.assert_allclose(got, to_numpy(want), rtol=rtol, atol=atol)
    for key, like in (("vars", vars0), ("params", params0)):
        for got, want in zip(_none_as_zeros(grads[key], like), _none_as_zeros(expected[key], like)):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    for got, want in zip(_none_as_zeros(in_graph, params0), _none_as_zeros(expected["params"], params0)):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# -- checkpointed segments and unrolls ---------------------------------------------


def _segmented_run(program, cuts, compiled):
    """The program under ``AssignAwareTape`` with its statements split at
    ``cuts`` into ``checkpointed`` segments, each given the parameters and
    the results so far as arguments and returning its own results."""
    from assigntape import checkpointed
    from assigntape.testing._interpreter import loss_of, run_statements

    vars0, params0, variables, params = state(program)
    bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(program.statements)), len(program.statements)]

    def body():
        with AssignAwareTape() as tape:
            tape.watch(params)
            store = VariableStore(variables, [tape])
            temps: List[Any] = []
            for a, b in zip(bounds, bounds[1:]):

                def segment(*args, chunk=program.statements[a:b]):
                    ts = list(args[len(params) :])
                    known = len(ts)
                    run_statements(program, chunk, store, args[: len(params)], ts)
                    return ts[known:]

                temps += list(checkpointed(segment)(*params, *temps))
            loss = loss_of(program, store, temps)
        grads = tape.gradient(loss, {"vars": variables, "params": tuple(params)})
        return loss, grads, [tf.convert_to_tensor(v) for v in variables]

    return tf.function(body)() if compiled else body()


def _check_against_rewrite(program, run):
    from assigntape.testing._program import assert_close, assert_gradients_close

    loss, grads, finals = run
    e_loss, e_grads, e_finals = rewrite_run(program)
    rtol, atol = tolerances(program)
    assert_close(loss, e_loss, rtol, atol, "loss")
    assert_close(finals, e_finals, rtol, atol, "final values")
    assert_gradients_close(grads, e_grads, rtol, atol, "gradients")


@settings(max_examples=_n(40))
@given(programs(stopped_writes=False), st.lists(st.integers(1, 7), max_size=3))
def test_random_programs_in_checkpointed_segments(program, cuts):
    """Any split of a program into segments equals the rewrite (and so the
    program without them)."""
    _check_against_rewrite(program, _segmented_run(program, cuts, False))


@settings(max_examples=_n(8))
@given(programs(stopped_writes=False, compiled=True), st.lists(st.integers(1, 7), max_size=2))
def test_random_programs_in_checkpointed_segments_compiled(program, cuts):
    _check_against_rewrite(program, _segmented_run(program, cuts, True))


@settings(max_examples=_n(25))
@given(programs(stopped_writes=False), st.integers(1, 4), st.integers(1, 3))
def test_random_programs_unrolled(program, steps, every):
    """The program as the step of ``unroll`` (its parameters constants:
    a step takes no arguments), against the same loop without it."""
    from assigntape import unroll
    from assigntape.testing._interpreter import loss_of, run_statements

    def run(unrolled):
        vars0, params0, variables, _ = state(program)
        params = [tf.constant(p, tf.float64) for p in params0]
        with AssignAwareTape() as tape:
            store = VariableStore(variables, [tape])

            def step():
                temps: List[Any] = []
                run_statements(program, program.statements, store, params, temps)
                return temps

            if unrolled:
                temps = unroll(step, steps, checkpoint_every=every)
            else:
                for _ in range(steps):
                    temps = step()
            loss = loss_of(program, store, temps)
        return loss, tape.gradient(loss, variables), [tf.convert_to_tensor(v) for v in variables]

    from assigntape.testing._program import assert_close, assert_gradients_close

    loss, grads, finals = run(True)
    e_loss, e_grads, e_finals = run(False)
    rtol, atol = tolerances(program)
    assert_close(loss, e_loss, rtol, atol, "loss")
    assert_close(finals, e_finals, rtol, atol, "final values")
    assert_gradients_close(grads, e_grads, rtol, atol, "gradients")
