"""Random programs of reads, writes and ops over variables, against the rewrite.

Hypothesis generates straight-line programs over a few variables of several
shapes and dtypes (float32, float64, complex128), some of them Keras 3
variables: reads by several paths (the C++ fast path, ``read_value``, Python
operators, ``tf.gather``, and ``tf.function``s one and two calls deep),
elementwise and matmul ops, ``assign`` / ``assign_add`` / ``assign_sub`` (some
with constants, some under ``stop_recording``), and partial writes of every
kind: scatter update/add/sub/mul/div/min/max, scatter_nd update/add/sub/min/max
and slice assignment, some with values that broadcast (a scalar, a row).
One interpreter runs each program twice:

* on ``tf.Variable``s under ``AssignAwareTape``;
* on tensors rebound by every write, under a plain ``tf.GradientTape`` (the
  oracle), where a write under ``stop_recording`` is ``tf.stop_gradient`` of
  the new value.

Variants: compiled (``tf.function``, and XLA); every write inside graph control
flow (``ControlFlowStore``); second order (the gradient of a first-order
gradient); infinite upstream gradients; tape events in the middle of a program
(an inner tape opened, the tape exited and entered again, ``reset()``); and, in
eager programs, writes inside a ``tf.function`` with ``untracked_writes="cut"``.

The gradients (and which ones are None) must agree. Where no write is under
``stop_recording`` (which deliberately differs from the math), a directional
finite difference of the rewrite in float64 / complex128 must agree with them too.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from assigntape import AssignAwareTape
from oracle import assert_grads_close, central_difference, to_numpy

# The CI profile's budgets below; the thorough profile runs ten times as many.
_SCALE = 10 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 1


def _n(examples: int) -> int:
    return examples * _SCALE


SHAPES = [(), (3,), (2, 3)]
DTYPES = [tf.float32, tf.float64, tf.complex128]
UNARY = {
    "tanh": tf.tanh,
    "sin": tf.sin,
    "half": lambda x: x * 0.5,
    "square": lambda x: 0.3 * x * x,
}
BINARY = ["add", "mul", "sub", "matvec"]
WRITES = ["assign", "assign_add", "assign_sub"]
PARTIAL = [
    "scatter_update", "scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max",
    "scatter_nd_update", "scatter_nd_add", "scatter_nd_sub", "scatter_nd_min", "scatter_nd_max", "slice",
]
ORDERED = ("scatter_min", "scatter_max", "scatter_nd_min", "scatter_nd_max")  # no complex numbers
BROADCASTING = ("scatter_update", "scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min",
                "scatter_max", "slice")
XLA_MISSING = ("scatter_nd_min", "scatter_nd_max")
REAL = [tf.float32, tf.float64]
READ_PATHS = 6  # identity, read_value, operator, gather, function, function in a function


@dataclass(frozen=True)
class Program:
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[Any, ...]
    n_params: int
    statements: Tuple[tuple, ...]
    seed: int
    keras: Tuple[bool, ...] = ()  # which variables are Keras 3 variables

    def initial_values(self):
        rng = np.random.default_rng(self.seed)
        vars0 = []
        for s, d in zip(self.shapes, self.dtypes):
            value = rng.uniform(-1, 1, size=s)
            if d.is_complex:
                value = value + 1j * rng.uniform(-1, 1, size=s)
            vars0.append(value)
        params0 = [rng.uniform(-1, 1) for _ in range(self.n_params)]
        return vars0, params0

    def is_keras(self, i: int) -> bool:
        return bool(self.keras) and self.keras[i]


@st.composite
def programs(draw, events: bool = False, function_writes: bool = False, max_statements: int = 8,
             dtypes: Sequence[Any] = DTYPES, xla: bool = False) -> Program:
    n_vars = draw(st.integers(1, 4))
    shapes = tuple(draw(st.sampled_from(SHAPES)) for _ in range(n_vars))
    dtypes = tuple(draw(st.sampled_from(list(dtypes))) for _ in range(n_vars))
    keras = tuple(not d.is_complex and draw(st.integers(0, 3)) == 0 for d in dtypes)
    n_params = draw(st.integers(0, 2))
    statements: List[tuple] = []
    n_temps = 0
    opened = paused = plain_inner = False

    def operand():
        kinds = ["var"] + (["temp"] if n_temps else []) + (["param"] if n_params else [])
        kind = draw(st.sampled_from(kinds))
        count = {"var": n_vars, "temp": n_temps, "param": n_params}[kind]
        return (kind, draw(st.integers(0, count - 1)), draw(st.integers(0, READ_PATHS - 1)))

    kinds_of_statement = ["read", "write", "write", "write_const", "write_stopped", "partial", "partial"]
    if events:
        kinds_of_statement += ["event"]
    if function_writes:
        kinds_of_statement += ["fn_write"]
    for _ in range(draw(st.integers(1, max_statements))):
        what = draw(st.sampled_from(kinds_of_statement))
        if what == "event":
            # A paused tape can only be resumed; with a plain inner tape open the
            # AssignAwareTape stays open (alone, a plain tape follows no writes).
            if paused:
                choices = ["resume"]
            else:
                choices = ["reset"] + ([] if plain_inner else ["pause"]) + ([] if opened else ["inner"])
            event = draw(st.sampled_from(choices))
            flag = draw(st.booleans())  # for "inner": ours (True) or plain
            opened |= event == "inner"
            plain_inner |= event == "inner" and not flag
            paused = event == "pause"
            statements.append(("event", event, flag))
        elif what == "partial":
            i = draw(st.integers(0, n_vars - 1))
            if not shapes[i]:
                continue  # a scalar has no part to write
            allowed = [k for k in PARTIAL if not (dtypes[i].is_complex and k in ORDERED)]
            if xla:  # XLA has no kernel for these
                allowed = [k for k in allowed if k not in XLA_MISSING]
            kind = draw(st.sampled_from(allowed))
            n = shapes[i][0]
            if kind == "slice":
                start = draw(st.integers(0, n - 1))
                rows = tuple(range(start, draw(st.integers(start + 1, n))))
            else:
                rows = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
            shapes_ok = ["", "scalar"] + (["row"] if kind == "slice" and len(shapes[i]) == 2 else [])
            # XLA's slice write does not broadcast.
            broadcasts = kind in BROADCASTING and not (xla and kind == "slice")
            broadcast = draw(st.sampled_from(shapes_ok)) if broadcasts else ""
            statements.append(
                ("partial", i, kind, rows, operand(), operand(), draw(st.sampled_from(BINARY)),
                 draw(st.sampled_from(sorted(UNARY))), broadcast)
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
    return Program(shapes, dtypes, n_params, tuple(statements), draw(st.integers(0, 2**31)), keras)


def _tf_variable(v: Any) -> Any:
    """The tf.Variable behind a Keras 3 variable (for the writes Keras lacks)."""
    return getattr(v, "value", v) if not isinstance(v, tf.Variable) else v


class VariableStore:
    """The program's state as tf.Variables (some wrapped by Keras 3), read by
    several paths."""

    def __init__(self, variables, tapes):
        self.variables, self.tapes = variables, list(tapes)
        self._functions = {}

    def _function_read(self, i, depth):
        key = (i, depth)
        if key not in self._functions:
            v = self.variables[i]
            inner = tf.function(lambda: tf.convert_to_tensor(v) * 1.0)
            self._functions[key] = inner if depth == 1 else tf.function(lambda: inner() + 0.0)
        return self._functions[key]()

    def read(self, i, path):
        v = self.variables[i]
        if path == 0:
            return tf.identity(v)  # C++ fast path
        if path == 1:
            return tf.convert_to_tensor(v) if not isinstance(v, tf.Variable) else v.read_value()
        if path == 2:
            return v * 1.0  # Python operator
        if path == 3:
            return tf.gather(v, tf.range(v.shape[0])) if v.shape.rank else v + 0.0
        return self._function_read(i, path - 3)

    def write(self, i, kind, value, stopped):
        method = getattr(self.variables[i], kind)
        if stopped:
            with _stopped(self.tapes):
                method(value)
        else:
            method(value)

    def write_part(self, i, kind, rows, value):
        v = _tf_variable(self.variables[i])
        if kind == "slice":
            v[rows[0] : rows[-1] + 1].assign(value)
        elif kind.startswith("scatter_nd"):
            op = "ResourceScatterNd" + kind[len("scatter_nd_"):].capitalize()
            getattr(tf.raw_ops, op)(ref=v.handle, indices=[[r] for r in rows], updates=value)
        else:
            # The raw op: unlike the methods, it takes a scalar update too.
            op = "ResourceScatter" + kind[len("scatter_"):].capitalize()
            getattr(tf.raw_ops, op)(resource=v.handle, indices=list(rows), updates=value)

    def write_in_function(self, i, kind, value):
        # One call deep for even-numbered variables, two for odd ones.
        v = self.variables[i]
        inner = tf.function(lambda x: getattr(v, kind)(x))
        (inner if i % 2 == 0 else tf.function(lambda x: inner(x)))(value)

    def final(self, i):
        return self.variables[i]


class _stopped:
    """``stop_recording`` on every tape of a store at once."""

    def __init__(self, tapes):
        self.contexts = [t.stop_recording() for t in tapes]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


class ControlFlowStore(VariableStore):
    """Every write made inside graph control flow that runs it exactly once:
    ``tf.cond`` branches whose predicate is a run-time true tensor, and loops over
    ``tf.range(one)`` with ``one`` a run-time 1, nested as ``layers`` says. The
    writes' versions leave through the conds' outputs and the loops' state."""

    def __init__(self, variables, tapes, pred, one, layers):
        super().__init__(variables, tapes)
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


def _rows_rewrite(combine):
    def rewrite(old, idx, u):
        rows = tf.gather_nd(old, idx)
        return tf.tensor_scatter_nd_update(old, idx, combine(rows, tf.broadcast_to(u, tf.shape(rows))))

    return rewrite


def _additive(sign):
    return lambda old, idx, u: tf.tensor_scatter_nd_add(old, idx, sign * tf.broadcast_to(u, tf.shape(tf.gather_nd(old, idx))))


PARTIAL_REWRITES = {
    "update": _rows_rewrite(lambda r, u: u),
    "add": _additive(1.0),
    "sub": _additive(-1.0),
    "mul": _rows_rewrite(lambda r, u: r * u),
    "div": _rows_rewrite(lambda r, u: r / u),
    "min": _rows_rewrite(tf.minimum),  # a tie goes to the previous value, as tf.minimum does
    "max": _rows_rewrite(tf.maximum),
}


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
        old = self.tensors[i]
        if kind == "slice":
            rest = tf.broadcast_to(value, (len(rows),) + tuple(old.shape[1:]))
            self.tensors[i] = tf.concat([old[: rows[0]], rest, old[rows[-1] + 1 :]], 0)
            return
        combine = kind.split("_")[-1]
        self.tensors[i] = PARTIAL_REWRITES[combine](old, [[r] for r in rows], value)

    def write_in_function(self, i, kind, value):
        self.write(i, kind, value, True)  # cut: a new version, no gradient path

    def final(self, i):
        return self.tensors[i]


def _compute_dtype(*xs):
    return tf.complex128 if any(x.dtype.is_complex for x in xs) else tf.float64


def _fit(x, shape, dtype):
    x = tf.cast(x, dtype)
    if x.shape == shape:
        return x
    return tf.broadcast_to(tf.reduce_mean(x), shape)


def _binary(op, a, b):
    dtype = _compute_dtype(a, b)
    a, b = tf.cast(a, dtype), tf.cast(b, dtype)
    if op == "matvec" and a.shape.rank == 2 and b.shape.rank == 1 and a.shape[1] == b.shape[0]:
        return tf.linalg.matvec(a, b)
    if a.shape != b.shape:
        a, b = tf.reduce_mean(a), tf.reduce_mean(b)
    return {"add": a + b, "mul": a * b, "sub": a - b, "matvec": a * b}[op]


def _real_term(x):
    x = tf.convert_to_tensor(x)
    if x.dtype.is_complex:
        return tf.reduce_sum(tf.tanh(tf.math.real(x))) + tf.reduce_sum(tf.sin(tf.math.imag(x)))
    return tf.reduce_sum(tf.tanh(tf.cast(x, tf.float64)))


def _part_value(program, i, kind, rows, value, broadcast):
    dtype = program.dtypes[i]
    if kind.endswith("div") or kind.endswith("mul"):
        value = 1.0 + 0.5 * tf.tanh(value)  # away from zero, for the divisor's sake
    if broadcast == "scalar":
        return tf.cast(tf.reduce_mean(value), dtype)
    if broadcast == "row":
        return _fit(value, tuple(program.shapes[i][1:]), dtype)
    return _fit(value, (len(rows),) + tuple(program.shapes[i][1:]), dtype)


def interpret(program: Program, store, params, on_event=None):
    temps: List[Any] = []

    def value_of(operand):
        kind, index, path = operand
        if kind == "var":
            return store.read(index, path)
        if kind == "temp":
            return temps[index]
        return params[index]

    for stmt in program.statements:
        if stmt[0] == "event":
            on_event(stmt[1], stmt[2], temps)
        elif stmt[0] == "read":
            _, operand, unary = stmt
            temps.append(UNARY[unary](value_of(operand)))
        elif stmt[0] == "partial":
            _, i, kind, rows, a, b, op, unary, broadcast = stmt
            value = UNARY[unary](_binary(op, value_of(a), value_of(b)))
            store.write_part(i, kind, rows, _part_value(program, i, kind, rows, value, broadcast))
        elif stmt[0] == "write_const":
            _, i, kind = stmt
            store.write(i, kind, tf.fill(program.shapes[i], tf.constant(0.25, program.dtypes[i])), False)
        else:
            what, i, kind, a, b, op, unary = stmt
            value = _fit(UNARY[unary](_binary(op, value_of(a), value_of(b))), program.shapes[i], program.dtypes[i])
            if what == "fn_write":
                store.write_in_function(i, kind, value)
            else:
                store.write(i, kind, value, what == "write_stopped")
    terms = [_real_term(t) for t in temps]
    terms += [_real_term(store.final(i)) for i in range(len(program.shapes))]
    return tf.add_n(terms)


def _variables(program: Program, vars0):
    import keras

    made = []
    for i, (v, d) in enumerate(zip(vars0, program.dtypes)):
        made.append(keras.Variable(v, dtype=d.name) if program.is_keras(i) else tf.Variable(v, dtype=d))
    return made


def _state(program: Program):
    """The program's start values, its variables, and its parameters as tensors."""
    vars0, params0 = program.initial_values()
    return vars0, params0, _variables(program, vars0), [tf.constant(p, tf.float64) for p in params0]


def tape_gradients(program: Program, compiled: bool = False, jit: bool = False, untracked: str = "raise"):
    vars0, params0, variables, params = _state(program)

    def body():
        with AssignAwareTape(untracked_writes=untracked) as tape:
            tape.watch(params)
            loss = interpret(program, VariableStore(variables, [tape]), params)
        return loss, tape.gradient(loss, {"vars": variables, "params": tuple(params)})

    return tf.function(body, jit_compile=jit)() if compiled else body()


def _oracle_dtype(dtype):
    return tf.complex128 if dtype.is_complex else tf.float64


def rewrite(program: Program, exact: bool = False, vars0=None, params0=None):
    """The rewrite's loss and gradients; ``exact`` computes in float64 /
    complex128 (for finite differences)."""
    v_init, p_init = program.initial_values()
    vars0 = v_init if vars0 is None else vars0
    params0 = p_init if params0 is None else params0
    dtypes = [_oracle_dtype(d) if exact else d for d in program.dtypes]
    tensors = [tf.constant(v, d) for v, d in zip(vars0, dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]
    if exact:
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


def _directions(rng, point_like: Sequence[Any]) -> List[np.ndarray]:
    out = []
    for p in point_like:
        d = rng.normal(size=np.shape(p))
        if np.iscomplexobj(p):
            d = d + 1j * rng.normal(size=np.shape(p))
        out.append(d)
    return out


def _check_finite_differences(program, grads):
    assert not any(stmt[0] in ("write_stopped", "fn_write") for stmt in program.statements)
    vars0, params0 = program.initial_values()
    point = [np.asarray(v) for v in vars0] + [np.asarray(p, np.float64) for p in params0]
    direction = _directions(np.random.default_rng(program.seed + 1), point)

    def f(x: Sequence[np.ndarray]) -> float:
        n = len(vars0)
        loss, _ = rewrite(program, True, list(x[:n]), list(x[n:]))
        return float(loss)

    fd = central_difference(f, point, direction, eps=1e-6)
    flat = list(grads["vars"]) + list(grads["params"])
    # TensorFlow's gradient of a real loss by a complex z is dL/dRe z + i dL/dIm z,
    # so the directional derivative along d is Re(conj(g) d).
    analytic = sum(
        0.0 if g is None else float(np.sum(np.real(np.conj(to_numpy(g).astype(np.complex128)) * d)))
        for g, d in zip(flat, direction)
    )
    np.testing.assert_allclose(analytic, fd, rtol=2e-3, atol=2e-3)


def _exact(program):
    return not any(stmt[0] in ("write_stopped", "fn_write") for stmt in program.statements)


@given(programs())
def test_random_programs_eager(program):
    loss, grads = tape_gradients(program)
    _check_against_rewrite(program, loss, grads)
    if _exact(program):
        _check_finite_differences(program, grads)


@settings(max_examples=_n(25))
@given(st.booleans().flatmap(lambda jit: st.tuples(programs(xla=jit), st.just(jit))))
def test_random_programs_compiled(program_and_jit):
    program, jit = program_and_jit
    loss, grads = tape_gradients(program, compiled=True, jit=jit)
    _check_against_rewrite(program, loss, grads)


@settings(max_examples=_n(40))
@given(programs(function_writes=True))
def test_random_programs_with_writes_in_functions_cut(program):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loss, grads = tape_gradients(program, untracked="cut")
    _check_against_rewrite(program, loss, grads)


def _none_as_zeros(grads, like):
    return [np.zeros(np.shape(l)) if g is None else to_numpy(g) for g, l in zip(grads, like)]


@settings(max_examples=_n(25))
@given(programs(), st.sampled_from(LAYERS))
def test_random_programs_with_every_write_in_control_flow(program, layers):
    vars0, params0, variables, params = _state(program)

    @tf.function
    def body(pred, one):
        with AssignAwareTape() as tape:
            tape.watch(params)
            loss = interpret(program, ControlFlowStore(variables, [tape], pred, one, layers), params)
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
        terms.append(tf.math.real(tf.reduce_sum(tf.cast(g, _oracle_dtype(g.dtype)) * tf.constant(r, _oracle_dtype(g.dtype)))))
    return tf.add_n(terms) if terms else None


def _second_order_tape(program, compiled):
    vars0, params0, variables, params = _state(program)

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
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]
    with tf.GradientTape() as outer:
        outer.watch(tensors + params)
        with tf.GradientTape() as inner:
            inner.watch(tensors + params)
            loss = interpret(program, TensorStore(tensors), params)
        z = _probe(program, inner.gradient(loss, {"vars": tensors, "params": tuple(params)}))
    return None if z is None else outer.gradient(z, {"vars": tensors, "params": tuple(params)})


@settings(max_examples=_n(60))
@given(programs(max_statements=6), st.booleans())
def test_random_programs_second_order(program, compiled):
    try:
        expected = _second_order_rewrite(program)
    except TypeError as e:
        # TensorFlow's own second derivative can fail: a gather's gradient is
        # IndexedSlices, which e.g. the gradient of TanhGrad does not accept.
        # The tape must fail the same way, not answer differently.
        with pytest.raises(TypeError, match="IndexedSlices"):
            _second_order_tape(program, compiled)
        assert "IndexedSlices" in str(e)
        return
    got = _second_order_tape(program, compiled)
    assert (got is None) == (expected is None)
    if expected is not None:
        rtol, atol = _tolerances(program)
        assert_grads_close(got, expected, rtol=rtol * 10, atol=atol * 10)


# -- infinite upstream gradients -----------------------------------------------


@settings(max_examples=_n(60))
@given(programs(dtypes=REAL))
def test_random_programs_with_an_infinite_upstream_gradient(program):
    # One element of the first variable's final value is weighed by inf: the
    # gradient is inf or NaN wherever the rewrite's is, and equal elsewhere.
    # (Real dtypes only: with complex numbers, inf times anything but a real
    # number is NaN, so two orders of the same complex products differ.)
    vars0, params0 = program.initial_values()
    weight = np.ones(program.shapes[0])
    weight.flat[0] = np.inf

    def loss_of(store, params):
        base = interpret(program, store, params)
        final = tf.convert_to_tensor(store.final(0))
        part = tf.math.real(final) if final.dtype.is_complex else final
        return base + tf.reduce_sum(tf.constant(weight, tf.float64) * tf.cast(part, tf.float64))

    variables = _variables(program, vars0)
    params = [tf.constant(p, tf.float64) for p in params0]
    with AssignAwareTape() as tape:
        tape.watch(params)
        loss = loss_of(VariableStore(variables, [tape]), params)
    got = tape.gradient(loss, {"vars": variables, "params": tuple(params)})
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.dtypes)]
    with tf.GradientTape() as oracle:
        oracle.watch(tensors + params)
        expected_loss = loss_of(TensorStore(tensors), params)
    expected = oracle.gradient(expected_loss, {"vars": tensors, "params": tuple(params)})
    rtol, atol = _tolerances(program)
    for a, e in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
        assert (a is None) == (e is None)
        if e is not None:
            np.testing.assert_allclose(to_numpy(a), to_numpy(e), rtol=rtol, atol=atol, equal_nan=True)


# -- tape events in the middle of a program ---------------------------------------


class _AwareEvents:
    """Events on the AssignAwareTape run: an inner tape (ours or plain) opened,
    the tape exited and entered again (writes meanwhile are unrecorded), reset()."""

    def __init__(self, tape, params, store):
        self.tape, self.params, self.store = tape, params, store
        self.inner: Optional[Any] = None

    def __call__(self, event, flag, temps):
        if event == "inner":
            self.inner = (AssignAwareTape if flag else tf.GradientTape)(persistent=True)
            self.inner.__enter__()
            self.inner.watch(self.params)
            self.store.tapes.append(self.inner)
        elif event == "pause":
            self.tape.__exit__(None, None, None)
            self.store.tapes.remove(self.tape)
        elif event == "resume":
            self.tape.__enter__()
            self.store.tapes.insert(0, self.tape)
        else:
            self.tape.reset()
            self.tape.watch(self.params)


class _RewriteEvents:
    """The same events on the rewrite: a plain inner tape watching the tensors
    current when it opens; stop_recording for the pause; reset() with the
    tensors current then as the new sources."""

    def __init__(self, tape, params, store):
        self.tape, self.params, self.store = tape, params, store
        self.inner: Optional[Any] = None
        self.inner_sources: List[Any] = []
        self.sources = list(store.tensors)
        self.pause: Optional[Any] = None

    def __call__(self, event, flag, temps):
        if event == "inner":
            self.inner = tf.GradientTape(persistent=True)
            self.inner.__enter__()
            self.inner_sources = list(self.store.tensors)
            self.inner.watch(self.inner_sources + self.params)
        elif event == "pause":
            self.pause = self.tape.stop_recording()
            self.pause.__enter__()
        elif event == "resume":
            self.pause.__exit__(None, None, None)
            self.pause = None
        else:
            self.tape.reset()
            self.sources = list(self.store.tensors)
            self.tape.watch(self.sources + self.params)


def _with_events_tape(program):
    vars0, params0, variables, params = _state(program)
    tape = AssignAwareTape(persistent=True)
    store = VariableStore(variables, [tape])
    events = _AwareEvents(tape, params, store)
    with tape:
        tape.watch(params)
        loss = interpret(program, store, params, events)
        if events.inner is not None:
            events.inner.__exit__(None, None, None)
    sources = {"vars": variables, "params": tuple(params)}
    inner = None if events.inner is None else events.inner.gradient(loss, sources)
    return loss, tape.gradient(loss, sources), inner


def _with_events_rewrite(program):
    vars0, params0 = program.initial_values()
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]
    store = TensorStore(tensors)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(tensors + params)
        events = _RewriteEvents(tape, params, store)
        loss = interpret(program, store, params, events)
        if events.pause is not None:
            events.pause.__exit__(None, None, None)
        if events.inner is not None:
            events.inner.__exit__(None, None, None)
    outer = tape.gradient(loss, {"vars": events.sources, "params": tuple(params)})
    inner = None
    if events.inner is not None:
        inner = events.inner.gradient(loss, {"vars": events.inner_sources, "params": tuple(params)})
    return loss, outer, inner


@settings(max_examples=_n(80))
@given(programs(events=True))
def test_random_programs_with_tape_events(program):
    # A tape paused at the end is entered again before the loss (the rewrite's
    # stop_recording ends there too).
    statements = list(program.statements)
    paused = False
    for stmt in statements:
        if stmt[0] == "event" and stmt[1] in ("pause", "resume"):
            paused = stmt[1] == "pause"
    if paused:
        statements.append(("event", "resume", False))
    program = Program(program.shapes, program.dtypes, program.n_params, tuple(statements), program.seed, program.keras)
    loss, outer, inner = _with_events_tape(program)
    expected_loss, expected_outer, expected_inner = _with_events_rewrite(program)
    rtol, atol = _tolerances(program)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=rtol, atol=atol)
    assert_grads_close(outer, expected_outer, rtol=rtol, atol=atol)
    assert (inner is None) == (expected_inner is None)
    if inner is not None:
        assert_grads_close(inner, expected_inner, rtol=rtol, atol=atol)


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


@settings(max_examples=_n(40))
@given(programs(), st.booleans())
def test_random_programs_variable_targets(program, compiled):
    # Each variable (Keras 3 ones included) as a target means its latest version.
    vars0, params0, variables, params = _state(program)

    def body():
        with AssignAwareTape(persistent=True) as tape:
            tape.watch(params)
            interpret(program, VariableStore(variables, [tape]), params)
        return [tape.gradient(v, {"vars": variables, "params": tuple(params)}) for v in variables]

    got = tf.function(body)() if compiled else body()
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.dtypes)]
    with tf.GradientTape(persistent=True) as oracle:
        oracle.watch(tensors + params)
        store = TensorStore(tensors)
        interpret(program, store, params)
    rtol, atol = _tolerances(program)
    for i, grads in enumerate(got):
        expected = oracle.gradient(store.final(i), {"vars": tensors, "params": tuple(params)})
        assert_grads_close(grads, expected, rtol=rtol, atol=atol)
