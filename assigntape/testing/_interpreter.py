"""One interpreter for random programs, over two kinds of state.

* ``VariableStore``: ``tf.Variable``s (some wrapped as Keras 3 variables), read
  by several paths and written by every kind of write, under
  ``AssignAwareTape``. ``ControlFlowStore`` makes every write inside graph
  control flow that runs it once.
* ``TensorStore``: the functional rewrite: tensors, each write rebinding one
  (a write under ``stop_recording`` rebinds ``tf.stop_gradient`` of the new
  value; a write in a ``tf.function``, which the tape cuts, too).

``tape_run`` and ``rewrite_run`` run a program on each, returning the loss, the
gradients with respect to the variables' start values and the parameters, and
the variables' final values. ``events_tape_run`` / ``events_rewrite_run`` do the
same for programs with tape events.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from assigntape._tape import AssignAwareTape
from assigntape.testing._vocabulary import BINARY, UNARY

if TYPE_CHECKING:  # pragma: no cover
    from assigntape.testing._program import Program

__all__ = [
    "VariableStore",
    "ControlFlowStore",
    "TensorStore",
    "interpret",
    "make_variables",
    "state",
    "tape_run",
    "rewrite_run",
    "events_tape_run",
    "events_rewrite_run",
    "oracle_dtype",
]

Gradients = Dict[str, Any]  # {"vars": [...], "params": (...)}


def _tf_variable(v: Any) -> Any:
    """The tf.Variable behind a Keras 3 variable (for the writes Keras lacks)."""
    return getattr(v, "value", v) if not isinstance(v, tf.Variable) else v


class VariableStore:
    """The program's state as tf.Variables (some wrapped by Keras 3), read by
    several paths."""

    def __init__(self, variables: Sequence[Any], tapes: Sequence[Any]) -> None:
        self.variables, self.tapes = list(variables), list(tapes)
        self._functions: Dict[Tuple[int, int], Callable[[], Any]] = {}

    def _function_read(self, i: int, depth: int) -> Any:
        key = (i, depth)
        if key not in self._functions:
            v = self.variables[i]
            inner = tf.function(lambda: tf.convert_to_tensor(v) * 1.0)
            self._functions[key] = inner if depth == 1 else tf.function(lambda: inner() + 0.0)
        return self._functions[key]()

    def read(self, i: int, path: int) -> Any:
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

    def write(self, i: int, kind: str, value: Any, stopped: bool) -> None:
        method = getattr(self.variables[i], kind)
        if stopped:
            with _Stopped(self.tapes):
                method(value)
        else:
            method(value)

    def write_part(self, i: int, kind: str, rows: Tuple[int, ...], value: Any) -> None:
        v = _tf_variable(self.variables[i])
        if kind == "slice":
            v[rows[0] : rows[-1] + 1].assign(value)
        elif kind.startswith("scatter_nd"):
            op = "ResourceScatterNd" + kind[len("scatter_nd_") :].capitalize()
            getattr(tf.raw_ops, op)(ref=v.handle, indices=[[r] for r in rows], updates=value)
        else:
            # The raw op: unlike the methods, it takes a scalar update too.
            op = "ResourceScatter" + kind[len("scatter_") :].capitalize()
            getattr(tf.raw_ops, op)(resource=v.handle, indices=list(rows), updates=value)

    def write_in_function(self, i: int, kind: str, value: Any, context: int = 0, followed: bool = False) -> None:
        # One of the contexts that run a write out of an eager tape's sight:
        # a tf.function one or two calls deep, a tf.data map iterated, a
        # Dataset.reduce (``context`` 0 to 3). (``followed``: the first two,
        # called in the tape's function, where the tape follows them.)
        v = self.variables[i]
        if context < 2:
            inner = tf.function(lambda x: getattr(v, kind)(x))
            (inner if context == 0 else tf.function(lambda x: inner(x)))(value)
        elif context == 2:
            # Not run ahead (autotune's injected prefetch would run the map in
            # tf.data's threads, which a tape refuses rather than cuts).
            options = tf.data.Options()
            options.autotune.enabled = False
            options.experimental_optimization.inject_prefetch = False
            ds = tf.data.Dataset.from_tensors(value).map(lambda x: (getattr(v, kind)(x), x)[1]).with_options(options)
            for _ in ds:
                pass
        else:
            tf.data.Dataset.from_tensors(value).reduce(np.int32(0), lambda s, x: (getattr(v, kind)(x), s)[1])

    def final(self, i: int) -> Any:
        return self.variables[i]


class _Stopped:
    """``stop_recording`` on every tape of a store at once."""

    def __init__(self, tapes: Sequence[Any]) -> None:
        self.contexts = [t.stop_recording() for t in tapes]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


class _LoopState(NamedTuple):
    step: Any
    extra: Any


class ControlFlowStore(VariableStore):
    """Every write made inside graph control flow that runs it exactly once:
    ``tf.cond`` branches whose predicate is a run-time true tensor, and loops over
    ``tf.range(one)`` with ``one`` a run-time 1, nested as ``layers`` says. The
    writes' versions leave through the conds' outputs and the loops' state."""

    def __init__(
        self, variables: Sequence[Any], tapes: Sequence[Any], pred: Any, one: Any, layers: Sequence[str]
    ) -> None:
        super().__init__(variables, tapes)
        self.pred, self.one, self.layers = pred, one, tuple(layers)

    def _inside(self, write: Callable[[], None], layers: Optional[Tuple[str, ...]] = None) -> None:
        layers = self.layers if layers is None else layers
        if not layers:
            write()
            return
        if layers[0] == "loop":
            for _ in tf.range(self.one):
                self._inside(write, layers[1:])
            return
        if layers[0] == "struct_loop":

            def body(state: _LoopState) -> Tuple[_LoopState]:
                self._inside(write, layers[1:])
                return (_LoopState(state.step + 1, {"scale": state.extra["scale"] * 1.0, "tag": state.extra["tag"]}),)

            start = _LoopState(tf.constant(0), {"scale": tf.constant(1.0), "tag": (tf.constant(7),)})
            tf.while_loop(lambda state: state.step < self.one, body, (start,))
            return
        if layers[0] == "struct_cond":

            def structured() -> Any:
                self._inside(write, layers[1:])
                return {"out": tf.constant(0.0), "more": (tf.constant(1), [tf.constant(2.0)])}

            tf.cond(
                self.pred, structured, lambda: {"out": tf.constant(0.0), "more": (tf.constant(1), [tf.constant(2.0)])}
            )
            return

        def taken() -> Any:
            self._inside(write, layers[1:])
            return tf.constant(0.0)

        tf.cond(self.pred, taken, lambda: tf.constant(0.0))

    def write(self, i: int, kind: str, value: Any, stopped: bool) -> None:
        self._inside(lambda: VariableStore.write(self, i, kind, value, stopped))

    def write_part(self, i: int, kind: str, rows: Tuple[int, ...], value: Any) -> None:
        self._inside(lambda: VariableStore.write_part(self, i, kind, rows, value))


def _rows(old: Any, idx: Any) -> Any:
    # tf.gather, not tf.gather_nd: TensorFlow's forward mode fails on
    # gather_nd, and the rewrite is the oracle for jvps too.
    return tf.gather(old, [i[0] for i in idx])


def _rows_rewrite(combine: Callable[[Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    def rewrite(old: Any, idx: Any, u: Any) -> Any:
        rows = _rows(old, idx)
        return tf.tensor_scatter_nd_update(old, idx, combine(rows, tf.broadcast_to(u, tf.shape(rows))))

    return rewrite


def _additive(sign: float) -> Callable[[Any, Any, Any], Any]:
    return lambda old, idx, u: tf.tensor_scatter_nd_add(old, idx, sign * tf.broadcast_to(u, tf.shape(_rows(old, idx))))


PARTIAL_REWRITES: Dict[str, Callable[[Any, Any, Any], Any]] = {
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

    def __init__(self, tensors: Sequence[Any]) -> None:
        self.tensors = list(tensors)

    def read(self, i: int, path: int) -> Any:
        t = self.tensors[i]
        return tf.gather(t, tf.range(t.shape[0])) if path == 3 and t.shape.rank else t

    def write(self, i: int, kind: str, value: Any, stopped: bool) -> None:
        old = self.tensors[i]
        new = {"assign": value, "assign_add": old + value, "assign_sub": old - value}[kind]
        # Under stop_recording the whole write goes unrecorded, the part kept
        # from the old value included.
        self.tensors[i] = tf.stop_gradient(new) if stopped else new

    def write_part(self, i: int, kind: str, rows: Tuple[int, ...], value: Any) -> None:
        old = self.tensors[i]
        if kind == "slice":
            rest = tf.broadcast_to(value, (len(rows),) + tuple(old.shape[1:]))
            self.tensors[i] = tf.concat([old[: rows[0]], rest, old[rows[-1] + 1 :]], 0)
            return
        combine = kind.split("_")[-1]
        self.tensors[i] = PARTIAL_REWRITES[combine](old, [[r] for r in rows], value)

    def write_in_function(self, i: int, kind: str, value: Any, context: int = 0, followed: bool = False) -> None:
        self.write(i, kind, value, not followed)  # cut: a new version, no gradient path

    def final(self, i: int) -> Any:
        return self.tensors[i]


def _compute_dtype(*xs: Any) -> Any:
    return tf.complex128 if any(x.dtype.is_complex for x in xs) else tf.float64


def _fit(x: Any, shape: Sequence[int], dtype: Any) -> Any:
    x = tf.cast(x, dtype)
    if x.shape == shape:
        return x
    return tf.broadcast_to(tf.reduce_mean(x), shape)


def _binary(op: str, a: Any, b: Any) -> Any:
    dtype = _compute_dtype(a, b)
    a, b = tf.cast(a, dtype), tf.cast(b, dtype)
    if op == "matvec" and a.shape.rank == 2 and b.shape.rank == 1 and a.shape[1] == b.shape[0]:
        return tf.linalg.matvec(a, b)
    if a.shape != b.shape:
        a, b = tf.reduce_mean(a), tf.reduce_mean(b)
    return {"add": a + b, "mul": a * b, "sub": a - b, "matvec": a * b}[op]


def _real_term(x: Any) -> Any:
    x = tf.convert_to_tensor(x)
    if x.dtype.is_complex:
        return tf.reduce_sum(tf.tanh(tf.math.real(x))) + tf.reduce_sum(tf.sin(tf.math.imag(x)))
    return tf.reduce_sum(tf.tanh(tf.cast(x, tf.float64)))


def _part_value(program: "Program", i: int, kind: str, rows: Tuple[int, ...], value: Any, broadcast: str) -> Any:
    dtype = program.tf_dtypes[i]
    if kind.endswith("div") or kind.endswith("mul"):
        value = 1.0 + 0.5 * tf.tanh(value)  # away from zero, for the divisor's sake
    if broadcast == "scalar":
        return tf.cast(tf.reduce_mean(value), dtype)
    if broadcast == "row":
        return _fit(value, tuple(program.shapes[i][1:]), dtype)
    return _fit(value, (len(rows),) + tuple(program.shapes[i][1:]), dtype)


EventHandler = Callable[[str, bool, List[Any]], None]


def interpret(program: "Program", store: Any, params: Sequence[Any], on_event: Optional[EventHandler] = None) -> Any:
    """Runs ``program`` on ``store``; returns its real float64 scalar loss."""
    temps: List[Any] = []
    run_statements(program, program.statements, store, params, temps, on_event)
    return loss_of(program, store, temps)


def loss_of(program: "Program", store: Any, temps: Sequence[Any]) -> Any:
    """The program's loss: a real term of every result and every variable's final value."""
    terms = [_real_term(t) for t in temps]
    terms += [_real_term(store.final(i)) for i in range(len(program.shapes))]
    return tf.add_n(terms)


def run_statements(
    program: "Program",
    statements: Sequence[Any],
    store: Any,
    params: Sequence[Any],
    temps: List[Any],
    on_event: Optional[EventHandler] = None,
) -> None:
    """Runs ``statements`` (some of ``program``'s) on ``store``, appending
    each result to ``temps`` (the results of the statements before them)."""
    dtypes = program.tf_dtypes

    def value_of(operand: Tuple[str, int, int]) -> Any:
        kind, index, path = operand
        if kind == "var":
            return store.read(index, path)
        if kind == "temp":
            return temps[index]
        return params[index]

    for stmt in statements:
        if stmt[0] == "event":
            if on_event is None:
                raise ValueError("this program has tape events: run it with an event handler")
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
            store.write(i, kind, tf.fill(program.shapes[i], tf.constant(0.25, dtypes[i])), False)
        else:
            what, i, kind, a, b, op, unary = stmt
            value = _fit(UNARY[unary](_binary(op, value_of(a), value_of(b))), program.shapes[i], dtypes[i])
            if what in ("fn_write", "fn_write_inline"):
                # The context, spread over the statement's other choices
                # (called in the tape's function: a tf.function, one or two
                # calls deep, whose write the tape follows).
                spread = i + BINARY.index(op) + list(UNARY).index(unary)
                followed = what == "fn_write_inline"
                store.write_in_function(i, kind, value, spread % (2 if followed else 4), followed)
            else:
                store.write(i, kind, value, what == "write_stopped")


def make_variables(program: "Program", vars0: Sequence[np.ndarray]) -> List[Any]:
    import keras

    made = []
    for i, (v, d) in enumerate(zip(vars0, program.tf_dtypes)):
        made.append(keras.Variable(v, dtype=d.name) if program.is_keras(i) else tf.Variable(v, dtype=d))
    return made


def state(program: "Program") -> Tuple[List[np.ndarray], List[float], List[Any], List[Any]]:
    """The program's start values, its variables, and its parameters as tensors."""
    vars0, params0 = program.initial_values()
    return vars0, params0, make_variables(program, vars0), [tf.constant(p, tf.float64) for p in params0]


def tape_run(
    program: "Program", compiled: bool = False, jit: bool = False, untracked: str = "raise"
) -> Tuple[Any, Gradients, List[Any]]:
    """Loss, gradients and final values of the program under ``AssignAwareTape``."""
    vars0, params0, variables, params = state(program)

    def body() -> Tuple[Any, Gradients, List[Any]]:
        with AssignAwareTape(untracked_writes=untracked) as tape:
            tape.watch(params)
            loss = interpret(program, VariableStore(variables, [tape]), params)
        grads = tape.gradient(loss, {"vars": variables, "params": tuple(params)})
        return loss, grads, [tf.convert_to_tensor(v) for v in variables]

    return tf.function(body, jit_compile=jit)() if compiled else body()


def oracle_dtype(dtype: Any) -> Any:
    return tf.complex128 if dtype.is_complex else tf.float64


def rewrite_run(
    program: "Program",
    exact: bool = False,
    vars0: Optional[Sequence[Any]] = None,
    params0: Optional[Sequence[Any]] = None,
) -> Tuple[Any, Gradients, List[Any]]:
    """The rewrite's loss, gradients and final values; ``exact`` computes in
    float64 / complex128 (for finite differences)."""
    v_init, p_init = program.initial_values()
    vars0 = v_init if vars0 is None else vars0
    params0 = p_init if params0 is None else params0
    dtypes = [oracle_dtype(d) if exact else d for d in program.tf_dtypes]
    tensors = [tf.constant(v, d) for v, d in zip(vars0, dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]
    if exact:
        program = dataclasses.replace(program, dtypes=tuple(d.name for d in dtypes), keras=())
    store = TensorStore(tensors)
    with tf.GradientTape() as oracle:
        oracle.watch(tensors + params)
        loss = interpret(program, store, params)
    grads = oracle.gradient(loss, {"vars": tensors, "params": tuple(params)})
    return loss, grads, [store.final(i) for i in range(len(tensors))]


# -- tape events in the middle of a program ---------------------------------------


class AwareEvents:
    """Events on the AssignAwareTape run: an inner tape (ours or plain) opened,
    the tape exited and entered again (writes meanwhile are unrecorded), reset()."""

    def __init__(self, tape: AssignAwareTape, params: Sequence[Any], store: VariableStore) -> None:
        self.tape, self.params, self.store = tape, list(params), store
        self.inner: Optional[Any] = None

    def __call__(self, event: str, flag: bool, temps: List[Any]) -> None:
        if event == "inner":
            if flag:
                # An inner tape of ours cuts what the outer one cuts: the
                # writes in tf.functions (else it would refuse them).
                self.inner = AssignAwareTape(persistent=True, untracked_writes=self.tape._untracked_writes)
            else:
                self.inner = tf.GradientTape(persistent=True)
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


class RewriteEvents:
    """The same events on the rewrite: a plain inner tape watching the tensors
    current when it opens; stop_recording for the pause; reset() with the
    tensors current then as the new sources."""

    def __init__(self, tape: Any, params: Sequence[Any], store: TensorStore) -> None:
        self.tape, self.params, self.store = tape, list(params), store
        self.inner: Optional[Any] = None
        self.inner_sources: List[Any] = []
        self.sources = list(store.tensors)
        self.pause: Optional[Any] = None

    def __call__(self, event: str, flag: bool, temps: List[Any]) -> None:
        if event == "inner":
            self.inner = tf.GradientTape(persistent=True)
            self.inner.__enter__()
            self.inner_sources = list(self.store.tensors)
            self.inner.watch(self.inner_sources + self.params)
        elif event == "pause":
            self.pause = self.tape.stop_recording()
            self.pause.__enter__()
        elif event == "resume":
            if self.pause is not None:
                self.pause.__exit__(None, None, None)
            self.pause = None
        else:
            self.tape.reset()
            self.sources = list(self.store.tensors)
            self.tape.watch(self.sources + self.params)


def events_tape_run(
    program: "Program", untracked: str = "raise"
) -> Tuple[Any, Gradients, Optional[Gradients], List[Any]]:
    """Loss, the tape's gradients, the inner tape's (if one opened) and the
    final values, of a program with events (ending with the tape entered)."""
    vars0, params0, variables, params = state(program)
    tape = AssignAwareTape(persistent=True, untracked_writes=untracked)
    store = VariableStore(variables, [tape])
    events = AwareEvents(tape, params, store)
    with tape:
        tape.watch(params)
        loss = interpret(program, store, params, events)
        if events.inner is not None:
            events.inner.__exit__(None, None, None)
    sources = {"vars": variables, "params": tuple(params)}
    inner = None if events.inner is None else events.inner.gradient(loss, sources)
    return loss, tape.gradient(loss, sources), inner, [tf.convert_to_tensor(v) for v in variables]


def events_rewrite_run(program: "Program") -> Tuple[Any, Gradients, Optional[Gradients], List[Any]]:
    vars0, params0 = program.initial_values()
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.tf_dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]
    store = TensorStore(tensors)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(tensors + params)
        events = RewriteEvents(tape, params, store)
        loss = interpret(program, store, params, events)
        if events.pause is not None:
            events.pause.__exit__(None, None, None)
        if events.inner is not None:
            events.inner.__exit__(None, None, None)
    outer = tape.gradient(loss, {"vars": events.sources, "params": tuple(params)})
    inner = None
    if events.inner is not None:
        inner = events.inner.gradient(loss, {"vars": events.inner_sources, "params": tuple(params)})
    return loss, outer, inner, [store.final(i) for i in range(len(tensors))]
