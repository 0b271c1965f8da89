"""Random programs of reads, writes and ops over variables, against the rewrite.

Hypothesis generates straight-line programs over a few variables of several
shapes and dtypes: reads by several paths, elementwise and matmul ops,
``assign`` / ``assign_add`` / ``assign_sub`` (some with constants, some under
``stop_recording``), and partial writes: scatter and scatter_nd updates, adds
and subs on unique rows, and slice assignment. One interpreter runs each program twice:

* on ``tf.Variable``s under ``AssignAwareTape``;
* on tensors rebound by every write, under a plain ``tf.GradientTape`` (the
  oracle), where a write under ``stop_recording`` is ``tf.stop_gradient`` of
  the new value.

Compiled, the same programs run with every write inside graph control flow
that runs it once (``ControlFlowStore``: ``tf.cond`` branches and loops, nested
up to two deep), whose versions leave through the conds' outputs and the loops'
state.

The gradients (and which ones are None) must agree. Where no write is under
``stop_recording`` (which deliberately differs from the math), a directional
finite difference of the rewrite in float64 must agree with them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import numpy as np
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from assigntape import AssignAwareTape
from oracle import assert_grads_close, central_difference, to_numpy

SHAPES = [(), (3,), (2, 3)]
DTYPES = [tf.float32, tf.float64]
UNARY = {
    "tanh": tf.tanh,
    "sin": tf.sin,
    "half": lambda x: x * 0.5,
    "square": lambda x: 0.3 * x * x,
}
BINARY = ["add", "mul", "sub", "matvec"]
WRITES = ["assign", "assign_add", "assign_sub"]
PARTIAL = ["scatter_update", "scatter_add", "scatter_sub", "scatter_nd_update", "scatter_nd_add", "slice"]


@dataclass(frozen=True)
class Program:
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[Any, ...]
    n_params: int
    statements: Tuple[tuple, ...]
    seed: int

    def initial_values(self):
        rng = np.random.default_rng(self.seed)
        vars0 = [rng.uniform(-1, 1, size=s) for s in self.shapes]
        params0 = [rng.uniform(-1, 1) for _ in range(self.n_params)]
        return vars0, params0


@st.composite
def programs(draw) -> Program:
    n_vars = draw(st.integers(1, 4))
    shapes = tuple(draw(st.sampled_from(SHAPES)) for _ in range(n_vars))
    dtypes = tuple(draw(st.sampled_from(DTYPES)) for _ in range(n_vars))
    n_params = draw(st.integers(0, 2))
    statements: List[tuple] = []
    n_temps = 0

    def operand():
        kinds = ["var"] + (["temp"] if n_temps else []) + (["param"] if n_params else [])
        kind = draw(st.sampled_from(kinds))
        count = {"var": n_vars, "temp": n_temps, "param": n_params}[kind]
        return (kind, draw(st.integers(0, count - 1)), draw(st.integers(0, 3)))

    for _ in range(draw(st.integers(1, 8))):
        what = draw(st.sampled_from(["read", "write", "write", "write_const", "write_stopped", "partial"]))
        if what == "partial":
            i = draw(st.integers(0, n_vars - 1))
            if not shapes[i]:
                continue  # a scalar has no part to write
            kind = draw(st.sampled_from(PARTIAL))
            n = shapes[i][0]
            if kind == "slice":
                start = draw(st.integers(0, n - 1))
                rows = tuple(range(start, draw(st.integers(start + 1, n))))
            else:
                rows = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
            statements.append(
                ("partial", i, kind, rows, operand(), operand(), draw(st.sampled_from(BINARY)),
                 draw(st.sampled_from(sorted(UNARY))))
            )
        elif what == "read":
            statements.append(("read", operand(), draw(st.sampled_from(sorted(UNARY)))))
            n_temps += 1
        elif what == "write_const":
            statements.append(("write_const", draw(st.integers(0, n_vars - 1)), draw(st.sampled_from(WRITES))))
        else:
            statements.append(
                (
                    what,
                    draw(st.integers(0, n_vars - 1)),
                    draw(st.sampled_from(WRITES)),
                    operand(),
                    operand(),
                    draw(st.sampled_from(BINARY)),
                    draw(st.sampled_from(sorted(UNARY))),
                )
            )
    return Program(shapes, dtypes, n_params, tuple(statements), draw(st.integers(0, 2**31)))


class VariableStore:
    """The program's state as tf.Variables, read by several paths."""

    def __init__(self, variables, tape):
        self.variables, self.tape = variables, tape

    def read(self, i, path):
        v = self.variables[i]
        if path == 0:
            return tf.identity(v)  # C++ fast path
        if path == 1:
            return v.read_value()
        if path == 2:
            return v * 1.0  # Python operator
        return tf.gather(v, tf.range(v.shape[0])) if v.shape.rank else v + 0.0

    def write(self, i, kind, value, stopped):
        method = getattr(self.variables[i], kind)
        if stopped:
            with self.tape.stop_recording():
                method(value)
        else:
            method(value)

    def write_part(self, i, kind, rows, value):
        v = self.variables[i]
        if kind == "slice":
            v[rows[0] : rows[-1] + 1].assign(value)
        elif kind.startswith("scatter_nd"):
            getattr(v, kind)([[r] for r in rows], value)
        else:
            getattr(v, kind)(tf.IndexedSlices(value, tf.constant(rows)))

    def final(self, i):
        return self.variables[i]


class ControlFlowStore(VariableStore):
    """Every write made inside graph control flow that runs it exactly once:
    ``tf.cond`` branches whose predicate is a run-time true tensor, and loops over
    ``tf.range(one)`` with ``one`` a run-time 1, nested as ``layers`` says. The
    writes' versions leave through the conds' outputs and the loops' state."""

    def __init__(self, variables, tape, pred, one, layers):
        super().__init__(variables, tape)
        self.pred, self.one, self.layers = pred, one, layers

    def _inside(self, write, layers=None):
        layers = self.layers if layers is None else layers
        if not layers:
            write()
            return
        if layers[0] == "loop":
            for _ in tf.range(self.one):
                self._inside(write, layers[1:])
            return

        def taken():
            self._inside(write, layers[1:])
            return tf.constant(0.0)

        tf.cond(self.pred, taken, lambda: tf.constant(0.0))

    def write(self, i, kind, value, stopped):
        self._inside(lambda: VariableStore.write(self, i, kind, value, stopped))

    def write_part(self, i, kind, rows, value):
        self._inside(lambda: VariableStore.write_part(self, i, kind, rows, value))


LAYERS = [("cond",), ("cond", "cond"), ("loop",), ("loop", "cond"), ("cond", "loop")]


class TensorStore:
    """The same state as plain tensors, rebound by each write: the rewrite."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def read(self, i, path):
        t = self.tensors[i]
        return tf.gather(t, tf.range(t.shape[0])) if path == 3 and t.shape.rank else t

    def write(self, i, kind, value, stopped):
        old = self.tensors[i]
        new = {"assign": value, "assign_add": old + value, "assign_sub": old - value}[kind]
        # Under stop_recording the whole write goes unrecorded, the part kept
        # from the old value included.
        self.tensors[i] = tf.stop_gradient(new) if stopped else new

    def write_part(self, i, kind, rows, value):
        combine = {"scatter_add": tf.tensor_scatter_nd_add, "scatter_sub": tf.tensor_scatter_nd_sub,
                   "scatter_nd_add": tf.tensor_scatter_nd_add}.get(kind, tf.tensor_scatter_nd_update)
        self.tensors[i] = combine(self.tensors[i], [[r] for r in rows], value)

    def final(self, i):
        return self.tensors[i]


def _fit(x, shape, dtype):
    x = tf.cast(x, dtype)
    if x.shape == shape:
        return x
    return tf.broadcast_to(tf.reduce_mean(x), shape)


def _binary(op, a, b):
    a, b = tf.cast(a, tf.float64), tf.cast(b, tf.float64)
    if op == "matvec" and a.shape.rank == 2 and b.shape.rank == 1 and a.shape[1] == b.shape[0]:
        return tf.linalg.matvec(a, b)
    if a.shape != b.shape:
        a, b = tf.reduce_mean(a), tf.reduce_mean(b)
    return {"add": a + b, "mul": a * b, "sub": a - b, "matvec": a * b}[op]


def interpret(program: Program, store, params, temps_dtype=None):
    temps: List[Any] = []

    def value_of(operand):
        kind, index, path = operand
        if kind == "var":
            return store.read(index, path)
        if kind == "temp":
            return temps[index]
        return params[index]

    for stmt in program.statements:
        if stmt[0] == "read":
            _, operand, unary = stmt
            temps.append(UNARY[unary](value_of(operand)))
        elif stmt[0] == "partial":
            _, i, kind, rows, a, b, op, unary = stmt
            value = UNARY[unary](_binary(op, value_of(a), value_of(b)))
            part_shape = (len(rows),) + tuple(program.shapes[i][1:])
            store.write_part(i, kind, rows, _fit(value, part_shape, program.dtypes[i]))
        elif stmt[0] == "write_const":
            _, i, kind = stmt
            store.write(i, kind, tf.fill(program.shapes[i], tf.constant(0.25, program.dtypes[i])), False)
        else:
            what, i, kind, a, b, op, unary = stmt
            value = UNARY[unary](_binary(op, value_of(a), value_of(b)))
            store.write(i, kind, _fit(value, program.shapes[i], program.dtypes[i]), what == "write_stopped")
    terms = [tf.reduce_sum(tf.tanh(tf.cast(t, tf.float64))) for t in temps]
    terms += [tf.reduce_sum(tf.sin(tf.cast(store.final(i), tf.float64))) for i in range(len(program.shapes))]
    return tf.add_n(terms)


def tape_gradients(program: Program, compiled: bool = False):
    vars0, params0 = program.initial_values()
    variables = [tf.Variable(v, dtype=d) for v, d in zip(vars0, program.dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]

    def body():
        with AssignAwareTape() as tape:
            tape.watch(params)
            loss = interpret(program, VariableStore(variables, tape), params)
        return loss, tape.gradient(loss, {"vars": variables, "params": tuple(params)})

    return tf.function(body)() if compiled else body()


def rewrite(program: Program, dtype_override=None, vars0=None, params0=None):
    v_init, p_init = program.initial_values()
    vars0 = v_init if vars0 is None else vars0
    params0 = p_init if params0 is None else params0
    dtypes = [dtype_override or d for d in program.dtypes]
    tensors = [tf.constant(v, d) for v, d in zip(vars0, dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]
    if dtype_override is not None:
        program = Program(program.shapes, tuple(dtypes), program.n_params, program.statements, program.seed)
    with tf.GradientTape() as oracle:
        oracle.watch(tensors + params)
        loss = interpret(program, TensorStore(tensors), params)
    return loss, oracle.gradient(loss, {"vars": tensors, "params": tuple(params)})


def _tolerances(program: Program):
    return (2e-4, 2e-5) if tf.float32 in program.dtypes else (1e-9, 1e-11)


def _check_against_rewrite(program, loss, grads):
    expected_loss, expected = rewrite(program)
    rtol, atol = _tolerances(program)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=rtol, atol=atol)
    assert_grads_close(grads, expected, rtol=rtol, atol=atol)


def _check_finite_differences(program, grads):
    assert not any(stmt[0] == "write_stopped" for stmt in program.statements)
    vars0, params0 = program.initial_values()
    point = [np.asarray(v, np.float64) for v in vars0] + [np.asarray(p, np.float64) for p in params0]
    rng = np.random.default_rng(program.seed + 1)
    direction = [rng.normal(size=np.shape(p)) for p in point]

    def f(x: Sequence[np.ndarray]) -> float:
        n = len(vars0)
        loss, _ = rewrite(program, tf.float64, list(x[:n]), list(x[n:]))
        return float(loss)

    fd = central_difference(f, point, direction, eps=1e-6)
    flat = list(grads["vars"]) + list(grads["params"])
    analytic = sum(0.0 if g is None else float(np.sum(to_numpy(g).astype(np.float64) * d)) for g, d in zip(flat, direction))
    np.testing.assert_allclose(analytic, fd, rtol=2e-3, atol=2e-3)


@given(programs())
def test_random_programs_eager(program):
    loss, grads = tape_gradients(program)
    _check_against_rewrite(program, loss, grads)
    if not any(stmt[0] == "write_stopped" for stmt in program.statements):
        _check_finite_differences(program, grads)


@settings(max_examples=25)
@given(programs())
def test_random_programs_compiled(program):
    loss, grads = tape_gradients(program, compiled=True)
    _check_against_rewrite(program, loss, grads)


def _none_as_zeros(grads, like):
    return [np.zeros(np.shape(l)) if g is None else to_numpy(g) for g, l in zip(grads, like)]


@settings(max_examples=25)
@given(programs(), st.sampled_from(LAYERS))
def test_random_programs_with_every_write_in_control_flow(program, layers):
    vars0, params0 = program.initial_values()
    variables = [tf.Variable(v, dtype=d) for v, d in zip(vars0, program.dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]

    @tf.function
    def body(pred, one):
        with AssignAwareTape() as tape:
            tape.watch(params)
            loss = interpret(program, ControlFlowStore(variables, tape, pred, one, layers), params)
        return loss, tape.gradient(loss, {"vars": variables, "params": tuple(params)})

    loss, grads = body(tf.constant(True), tf.constant(1))
    expected_loss, expected = rewrite(program)
    rtol, atol = _tolerances(program)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=rtol, atol=atol)
    # The branch not taken reads the variables it leaves alone, and a loop
    # carries them, so where the rewrite has no gradient a graph gives zeros
    # (as tf.cond and tf.while_loop do).
    for key, like in (("vars", vars0), ("params", params0)):
        for got, want in zip(_none_as_zeros(grads[key], like), _none_as_zeros(expected[key], like)):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


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
    loss, grads = tape_gradients(program)
    _check_against_rewrite(program, loss, grads)
    _check_finite_differences(program, grads)
    assert grads["params"][0] is not None and abs(float(grads["params"][0])) > 1e-3
