"""Checkpointed steps and unrolls: one recorded op per segment, re-run backward.

A segment (a ``checkpointed`` call, or ``checkpoint_every`` steps of an
``unroll``) runs with the tapes of its scope paused. The library's read and
write paths still serve and make versions, and a log on the scope's
``owners`` (which every served handle passes through) notes each variable the
segment touches and, at its first touch (before any write of it), keeps a
copy of its value: the checkpoint. Afterwards the scope is put back as it was
(``Scope.state`` / ``put_back``): the segment's inner versions are forgotten,
and each floating-point variable it wrote gets one new version, the output of
ONE op recorded on the tapes whose inputs are the versions current at the
segment's start (and the tensors given to it) and whose outputs are those new
versions and the float tensors it returned.

That op's backward function puts the checkpoint back in the variables, runs
the step again under a fresh ``AssignAwareTape`` (the scope set aside),
differentiates it from its start to its ends, and puts the variables back as
they were. So the tape keeps, per segment, the checkpoint and the versions at
its boundary, and nothing from inside it.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from assigntape import _registry, _resuming, _versions, _writes
from assigntape._errors import RecomputeError
from assigntape._record import WriteRecord
from assigntape._tape import AssignAwareTape
from assigntape._tf import (
    context,
    dtypes,
    forwardprop,
    gen_resource_variable_ops,
    indexed_slices,
    nest,
    op_callbacks,
    op_def_registry,
    ops,
    pywrap_tfe,
    record,
    tensor_lib,
)

__all__ = ["checkpointed", "unroll"]

# Stateful ops whose side effect changes no value the step computes with.
_HARMLESS = frozenset(["Assert", "Print", "PrintV2", "Timestamp", "EagerPyFunc", "PyFunc"])
# Ops that take the next element of an iterator: one made before the step
# holds a position no variable holds (the re-run would take the next ones).
_ITERATOR_NEXT = frozenset(
    ["IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "MultiDeviceIteratorGetNextFromShard"]
)
_RESOURCE = 20  # types_pb2.DT_RESOURCE


@functools.lru_cache(maxsize=None)
def _hidden_state_op(op_type: str) -> bool:
    """A primitive op with a state no variable holds: stateful (op_def), and
    neither a variable's nor any resource's op (those take or make a resource:
    a variable, whose value the checkpoint holds, such as a tf.random.Generator's
    state, or a table, queue or tensor array), nor one whose side effect no
    value sees (an assertion, a print). What is left draws from a per-op state
    in the kernel: the random ops and candidate samplers. (The stateless
    random ops Keras' SeedGenerator feeds are not stateful.)"""
    op_def = op_def_registry.get(op_type)
    if op_def is None or not op_def.is_stateful or op_type in _HARMLESS:
        return False
    args = [*op_def.input_arg, *op_def.output_arg]
    return not any(a.type == _RESOURCE for a in args) and not any(a.name == "f" for a in op_def.attr)


def _function_def(name: str) -> Any:
    graph: Any = ops.get_default_graph()
    while graph is not None:
        found = graph._get_function(name) if hasattr(graph, "_get_function") else None
        if found is not None:
            return found.cached_definition if hasattr(found, "cached_definition") else found.definition
        graph = getattr(graph, "outer_graph", None)
    try:
        return context.context().get_function_def(name)
    except Exception:  # noqa: BLE001 - not a function known here: nothing to look into
        return None


def _hidden_state_in(op_type: str, attrs: Any, seen: Set[str]) -> Optional[str]:
    """The first op with hidden state (``_hidden_state_op``) in ``op_type``
    or, for a function (a call of a traced tf.function, a cond or loop op),
    in the functions it runs, looked into (once each); or None."""
    if _hidden_state_op(op_type):
        return op_type
    names = [op_type] if op_def_registry.get(op_type) is None else []
    for value in attrs:
        names += [value.func.name] if value.HasField("func") else []
        names += [f.name for f in value.list.func]
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        fdef = _function_def(name)
        for node in fdef.node_def if fdef is not None else ():
            found = _hidden_state_in(node.op, list(node.attr.values()), seen)
            if found is not None:
                return f"{found} (in {name})"
    return None


_WRITE = "Checkpointed"


class _TouchLog(Dict[int, Any]):
    """A scope's ``owners`` while a segment runs: every served handle is set
    here, so the first setting of each variable is its first touch in the
    segment, before any write of it (a write fetches the handle it writes
    through first). There its value is copied. Nothing here may raise (the
    handle descriptor calls it from TensorFlow's C++ code): an error is kept
    for the segment to raise."""

    def __init__(self, base: Dict[int, Any]) -> None:
        super().__init__(base)
        self.touched: Dict[str, Tuple[Any, Any]] = {}
        self.error: Optional[BaseException] = None

    def __setitem__(self, key: int, var: Any) -> None:
        super().__setitem__(key, var)
        self.note(var)

    def note(self, var: Any) -> None:
        """``var`` touched: at its first touch, its value copied."""
        uid = var.__dict__.get("_unique_id")
        if uid is None or uid in self.touched:
            return
        self.touched[uid] = (var, None)
        try:
            self.touched[uid] = (var, _read(var))
        except BaseException as error:  # noqa: B036 - kept, raised by the segment
            if self.error is None:
                self.error = error


def _read(var: Any) -> Any:
    """The variable's value now, through its own handle, on no tape."""
    with record.stop_recording():
        return gen_resource_variable_ops.read_variable_op(var.__dict__["_handle"], var.dtype)


def _assign(var: Any, value: Any) -> None:
    with record.stop_recording():
        gen_resource_variable_ops.assign_variable_op(var.__dict__["_handle"], value)


def _float(dtype: Any) -> bool:
    return bool(dtype.is_floating or dtype.is_complex)


class _Refusals:
    """What the first run of a segment must not do: create a variable, run a
    random op whose state no variable holds, or compute with a tensor that
    the paused tapes watch and that was not given as an argument (a tensor
    the step closes over: the segment would cut its gradient). Each is a
    ``RecomputeError``, raised at the op (before it runs, eagerly)."""

    def __init__(self, name: str, paused: List[Any], args: Sequence[Any], log: _TouchLog, key: Any) -> None:
        self.name = name
        self.key = key  # the segment's graph (None: eager)
        self.paused = paused
        self.log = log
        # What the step made (op outputs), and was given: never the tapes'.
        self.inside: Set[int] = {_key(a) for a in args if isinstance(a, tensor_lib.Tensor)}
        # Eager tensors' ids only grow: one at least this was made in the step
        # (also the reads TensorFlow's C fast path makes of a variable passed
        # to an op, which no op callback sees).
        self.first_id = ops.uid()

    def creator(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        raise RecomputeError(
            f"{self.name} created a variable ({kwargs.get('name') or 'unnamed'}) inside a checkpointed "
            "step: its re-run in the backward pass would create another. Create every variable "
            "before the step (build the model, and the optimizer: opt.build(model.trainable_variables))."
        )

    def callback(
        self, op_type: str, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None, graph: Any = None
    ) -> Any:
        if graph is None:  # (a graph's ops: looked at once it is built, ``scan``)
            found = _hidden_state_in(op_type, (), set())  # (a function: its name)
            iterator = inputs[0] if op_type in _ITERATOR_NEXT and inputs else None
            if found is None and iterator is not None and not self.made(iterator):
                found = op_type
            if found is not None:
                self.refuse_hidden_state(found)
        if graph is not self.key:
            return None  # a function traced meanwhile: its own graph
        for t in inputs or ():
            if isinstance(t, tensor_lib.Tensor) and t.dtype == dtypes.resource:
                # A variable a called tf.function reads through the handle it
                # captured: not served, so noted here (after the call eagerly:
                # a function that writes is refused or cut anyway).
                var = _variable_of(t, self.log)
                if var is not None:
                    self.log.note(var)
        outside = [t for t in inputs or () if _float_tensor(t) and not self.made(t)]
        if outside and self.paused:  # (the re-run: its own tape watches all)
            self._refuse_watched(op_type, outside)
        for t in outputs or ():
            if isinstance(t, tensor_lib.Tensor):
                self.inside.add(_key(t))
        return None

    def made(self, t: Any) -> bool:
        """``t`` was given to the step or made by it."""
        return _key(t) in self.inside or (isinstance(t, ops.EagerTensor) and t._id >= self.first_id)

    def refuse_hidden_state(self, found: str) -> None:
        raise RecomputeError(
            f"{self.name} ran the stateful op {found}, whose state no variable holds (a random op, "
            "a candidate sampler, the next element of an iterator made before the step): its re-run "
            "in the backward pass would draw other values, a silently different gradient. Draw from "
            "a tf.random.Generator, a Keras SeedGenerator, or a stateless op "
            "(tf.random.stateless_uniform) whose seed is a variable or an argument; pass the batch "
            "as an argument (checkpointed(step)(next(it)))."
        )

    def scan(self, graph: Any, start: int) -> None:
        """The ops the step added to ``graph`` (from the ``start``-th): the
        same refusal as eagerly (a call of a function traced before reaches no
        op callback)."""
        made = graph.get_operations()[start:]
        inside = {id(op) for op in made}
        for op in made:
            found = _hidden_state_in(op.type, list(op.node_def.attr.values()), set())
            source = op.inputs[0].op if op.type in _ITERATOR_NEXT else None
            # (an iterator from outside: a capture, whose placeholder may be new)
            if found is None and source is not None and (source.type == "Placeholder" or id(source) not in inside):
                found = op.type
            if found is not None:
                self.refuse_hidden_state(f"{found} ({op.name})")
            # (a call of a function, which no graph op callback sees, takes
            # what the function captures as inputs: the closes-over refusal)
            outside = [t for t in op.inputs if _float_tensor(t) and id(t.op) not in inside and not self.made(t)]
            if outside and self.paused:
                self._refuse_watched(op.type, outside)

    def _refuse_watched(self, op_type: str, tensors: List[Any]) -> None:
        """Refuses a tensor from outside the step that a paused tape watches
        (asked with them back in TensorFlow's tape set, for that moment)."""
        # (A tf.function's call runs with the tape set stopped: its captures,
        # inputs of the call op, are asked with it restarted for that moment.)
        stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
        for r in self.paused:
            r.resume()
        try:
            watched = pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop(tensors)
        finally:
            for r in reversed(self.paused):
                r.pause()
            if stopped:
                pywrap_tfe.TFE_Py_TapeSetStopOnThread()
        if watched:
            raise RecomputeError(
                f"{self.name}: its op {op_type} takes a tensor that the tape differentiates and the "
                "step closes over: a segment would cut its gradient. Pass it as an argument, "
                "checkpointed(fn)(tensor), or read it from a variable."
            )


def _variable_of(handle: Any, log: _TouchLog) -> Optional[Any]:
    """The variable behind a resource input: a version served here, a
    variable's own eager handle, or (in a function's graph) the capture of one."""
    var = log.get(id(handle))
    if var is None:
        var = _versions.variable_of_handle(handle)
    if var is None and not isinstance(handle, ops.EagerTensor):
        for outside, inside in getattr(handle.graph, "captures", ()):
            if inside is handle:
                return _versions.variable_of_handle(outside)
    return var


def _key(t: Any) -> int:
    """A tensor's identity while the segment runs: an eager tensor's
    never-reused ``_id``, a graph tensor's ``id`` (its graph keeps it)."""
    found: int = t._id if isinstance(t, ops.EagerTensor) else id(t)
    return found


class _Segment:
    """What the backward pass of one segment needs: how to run it again, the
    checkpoint, and what its recorded op's inputs and outputs are."""

    def __init__(
        self,
        name: str,
        run: Callable[..., Any],
        args: Sequence[Any],
        touched: Dict[str, Tuple[Any, Any]],
        inputs: List[Any],
        written: List[Any],
        float_out: List[int],
    ) -> None:
        self.name = name
        self.run = run
        self.args = list(args)
        self.touched = touched
        self.inputs = inputs  # the floating-point variables touched
        self.written = written  # the floating-point variables written
        self.float_out = float_out  # indices, in nest.flatten(result), of float tensors
        # Of the first run: a fingerprint of each written variable's value at
        # its end, then of each float tensor returned (``_fingerprints``).
        self.prints: List[Any] = []

    def backward(self, *upstream: Any) -> List[Any]:
        """The gradients for the recorded op's inputs (the versions of
        ``inputs`` at the segment's start, then the float tensor arguments)
        from those of its outputs (the new versions of ``written``, then the
        float tensors returned)."""
        key = _registry.current_key()
        scopes = _registry._scopes()
        outer = scopes.pop(key, None)
        paused = [r for r in outer.records if r.recording()] if outer is not None else []
        for r in paused:
            r.pause()
        try:
            saved = [(var, _read(var)) for var, _ in self.touched.values()]
            try:
                return self._differentiate(upstream)
            finally:
                for var, value in saved:
                    _assign(var, value)
        finally:
            for r in reversed(paused):
                r.resume()
            if outer is not None:
                scopes[key] = outer

    def _differentiate(self, upstream: Sequence[Any]) -> List[Any]:
        # In a graph, the re-run starts once the gradients it is given are
        # computed (the segment after it done): else the executor may run
        # every segment's re-run ahead at once, holding all their activations.
        given = [g for g in upstream if isinstance(g, tensor_lib.Tensor) and not isinstance(g, ops.EagerTensor)]
        with ops.control_dependencies(given):
            for var, value in self.touched.values():
                _assign(var, value)
        tensors = [a for a in self.args if _float_tensor(a)]
        with AssignAwareTape() as tape:
            scope = tape._scope
            assert scope is not None
            log = scope.owners = _TouchLog(scope.owners)
            for var in self.inputs:
                tape.watch(var)
            tape.watch(tensors)
            notes = _Refusals(self.name, [], self.args, log, scope.key)
            op_callbacks.add_op_callback(notes.callback)
            try:
                result = self.run(*self.args)
            finally:
                op_callbacks.remove_op_callback(notes.callback)
        # A variable the first run did not touch has no copy; one it wrote and
        # the re-run did not (or the other way) is another step.
        wrote = {uid for uid in tape._record.versions}
        if not set(log.touched) <= set(self.touched) or wrote != {v._unique_id for v in self.written}:
            raise RecomputeError(
                f"{self.name}: its re-run in the backward pass touched or wrote other variables than "
                f"its first run ({_names(log.touched, self.touched, wrote, self.written)}): a Python "
                "side effect of the step changed what it does. Keep the step a function of the "
                "variables and its arguments."
            )
        flat = nest.flatten(result)
        check = self._check_same(flat)
        targets: List[Any] = []
        grads_out: List[Any] = []
        ends = list(self.written) + [flat[i] for i in self.float_out]
        for end, g in zip(ends, upstream):
            if g is None:
                continue
            if isinstance(g, indexed_slices.IndexedSlices):
                g = ops.convert_to_tensor(g)
            targets.append(end)
            grads_out.append(g)
        sources = list(self.inputs) + tensors
        if not targets:
            return [None] * len(sources)
        grads: List[Any] = tape.gradient(targets, sources, output_gradients=grads_out)
        if check is None:
            return grads
        with ops.control_dependencies(check):  # the gradients fail where the re-run differs
            return [None if g is None else _identity(g) for g in grads]

    def _check_same(self, flat: List[Any]) -> Optional[List[Any]]:
        """The re-run's ends compared with the first run's (fingerprints): a
        stateful op whose state no variable holds (not refused up front: an
        iterator, a py_function drawing random numbers, ...) makes them
        differ. Eagerly a ``RecomputeError``; in a graph, assertions for the
        gradients to depend on (None eagerly)."""
        names = [f"the variable {v.name!r}" for v in self.written]
        names += [f"its returned tensor {i} (of nest.flatten)" for i in self.float_out]
        again = _fingerprints(self.written, [flat[i] for i in self.float_out])
        checks: List[Any] = []
        dtypes_ = [v.dtype for v in self.written] + [flat[i].dtype for i in self.float_out]
        for what, dtype, first, second in zip(names, dtypes_, self.prints, again):
            message = (
                f"{self.name}: its re-run in the backward pass computed another value of {what} "
                "than its first run: the step depends on a state no variable holds (a stateful "
                "op: a random op, an iterator, a py_function, a Python side effect), so the "
                "gradient would be another computation's. Draw randomness from a "
                "tf.random.Generator or a seed variable, pass data as arguments."
            )
            with record.stop_recording():
                tol = _rtol(dtype) * tf.stack([first[1], first[1], first[2]]) + _TINY
                same = tf.reduce_all(tf.abs(first - second) <= tol) | tf.reduce_any(tf.math.is_nan(first))
                if tf.executing_eagerly():
                    if not bool(same):
                        raise RecomputeError(message)
                else:
                    checks.append(tf.debugging.Assert(same, [message]))
        return checks if checks else None


_TINY = 1e-30


def _fingerprints(variables: List[Any], tensors: List[Any]) -> List[Any]:
    """Per value (each variable's now, then each tensor), float64 [sum,
    sum of absolute values, sum of squares]: O(1) memory, the same for the
    same bits."""
    found: List[Any] = []
    with record.stop_recording():
        for x in [_read(v) for v in variables] + list(tensors):
            if x.dtype.is_complex:
                x = tf.concat([tf.reshape(tf.math.real(x), [-1]), tf.reshape(tf.math.imag(x), [-1])], 0)
            x = tf.cast(x, tf.float64)
            found.append(tf.stack([tf.reduce_sum(x), tf.reduce_sum(tf.abs(x)), tf.reduce_sum(x * x)]))
    return found


def _rtol(dtype: Any) -> float:
    """The same ops on the same device give the same bits; a little room (a
    few rounding steps of ``dtype``'s, relative to the sum of absolute values)
    for a graph's optimizer rewriting one run and not the other."""
    return 3e-2 if dtype.real_dtype.size <= 2 else 1e-6


def _identity(g: Any) -> Any:
    with record.stop_recording():
        return tf.identity(g)


def _body_kind(graph: Any) -> str:
    kind = type(graph).__name__
    return "tf.cond branch" if "Cond" in kind else "loop body" if "While" in kind else f"graph {graph.name!r}"


def _accumulating(recorder: Any) -> bool:
    return isinstance(recorder, forwardprop.ForwardAccumulator) and bool(recorder._recording)


def _float_tensor(x: Any) -> bool:
    return isinstance(x, tensor_lib.Tensor) and x.dtype != dtypes.resource and _float(x.dtype)


def _names(a: Dict[str, Tuple[Any, Any]], b: Dict[str, Tuple[Any, Any]], wrote: Set[str], written: List[Any]) -> str:
    found = {uid: var for uid, (var, _) in {**a, **b}.items()}
    differ = (set(a) - set(b)) | (wrote ^ {v._unique_id for v in written})
    return ", ".join(sorted(repr(found[uid].name) for uid in differ if uid in found))


def _segment(name: str, run: Callable[..., Any], args: Sequence[Any], returns: bool = True) -> Any:
    """Runs ``run(*args)`` as one segment of the tape open here, if any;
    ``returns``: its float results are outputs of the segment's op (not for
    an unroll's segments before the last, whose results are dropped:
    TensorFlow would give an output nothing used zeros, not None)."""
    scopes = getattr(_registry._tls, "scopes", None)
    scope = _registry._enclosing_scope(scopes) if scopes else None
    if scope is None or pywrap_tfe.TFE_Py_TapeSetIsStopped() or not any(r.recording() for r in scope.records):
        # Nothing records here: the step is what it is without the wrapper.
        return run(*args)
    paused = [r for r in scope.records if r.recording()]
    before = scope.state(True)
    lengths = [{uid: len(v) for uid, v in r.versions.items()} for r in paused]
    owners = scope.owners
    log = _TouchLog(owners)
    refusals = _Refusals(name, paused, args, log, scope.key)
    for r in paused:
        r.pause()
    try:
        if any(_accumulating(ref()) for ref, _ in _registry.open_plain()):
            raise RecomputeError(
                f"{name} was called while a ForwardAccumulator records around it: a segment is "
                "recorded for reverse mode only, and its outputs would have no tangent. Call the "
                "step without the wrapper under forward mode (whose memory does not grow with steps)."
            )
        if not pywrap_tfe.TFE_Py_TapeSetIsEmpty():
            raise RecomputeError(
                f"{name} was called while a plain tf.GradientTape records around it: that tape would "
                "see none of the step. Make every recording tape around it an AssignAwareTape."
            )
        graph = None if scope.key is None else ops.get_default_graph()
        if graph is not None and graph is not scope.key:
            raise RecomputeError(
                f"{name} was called inside a {_body_kind(graph)} of the tape's tf.function: its "
                "recorded op and re-run would be in that body, which TensorFlow differentiates on "
                "its own. Call the wrapper outside tf.cond / tf.while_loop (a Python if or loop), "
                "or the step without it there."
            )
        start = len(graph.get_operations()) if graph is not None else ops.uid()
        scope.owners = log
        op_callbacks.add_op_callback(refusals.callback)
        try:
            with tf.variable_creator_scope(refusals.creator):
                result = run(*args)
            if log.error is not None:
                raise log.error
            if graph is not None:
                refusals.scan(graph, start)
        except BaseException:
            # Refused (or failed) part way: the variables and the tapes as
            # before the step, as a refused write leaves them.
            for var, value in log.touched.values():
                if value is not None:
                    _assign(var, value)
            _forget_inner_versions(scope, before, paused, lengths)
            raise
        finally:
            op_callbacks.remove_op_callback(refusals.callback)
            scope.owners = owners
    finally:
        for r in reversed(paused):
            r.resume()
    after = dict(scope.current)
    _forget_inner_versions(scope, before, paused, lengths)
    for var, _ in log.touched.values():
        own = _versions.canonical_handle(var)
        if id(own) in scope.dirty:
            # Written while a tape here was closed, or a tape here entered
            # again, and not read since: the step's first read of it resolves
            # that (rule 6), here as if made just before the step, so that the
            # segment starts from the version a read there would give.
            _resuming.cut_on_first_read(scope, var, own)
    entry = dict(scope.current)
    inputs: List[Any] = []
    starts: List[Any] = []
    written: List[Any] = []
    for uid, (var, _) in log.touched.items():
        scope.seen.add(uid)
        if not _float(var.dtype):
            continue
        inputs.append(var)
        starts.append(entry.get(uid, _versions.canonical_handle(var)))
        if after.get(uid) is not entry.get(uid):
            written.append(var)
    flat = nest.flatten(result)
    # A returned tensor that existed before the step (an argument, one it
    # closes over) is itself, with its own gradient path: not the op's output.
    made = {id(op) for op in graph.get_operations()[start:]} if graph is not None else set()
    float_out = [
        i
        for i, t in enumerate(flat)
        if returns and _float_tensor(t) and (t._id >= start if graph is None else id(t.op) in made)
    ]
    tensors = [a for a in args if _float_tensor(a)]
    segment = _Segment(name, run, args, log.touched, inputs, written, float_out)
    segment.prints = _fingerprints(written, [flat[i] for i in float_out])
    # Watched as the step's reads would have them watched (the versions at
    # its start), before the new versions are made current.
    for var, _ in log.touched.values():  # (all, as the reads would: watched_variables lists them)
        _writes.watch(scope, var)
    ends = [_versions.new_version(after[var._unique_id], None) for var in written]
    outputs = [*ends, *(flat[i] for i in float_out)]
    record.record_operation_backprop_only(_WRITE, outputs, [*starts, *tensors], segment.backward)
    for var, end in zip(written, ends):
        scope.advance(var, scope.current_version(var), end, WriteRecord(_WRITE))
    return result


def _forget_inner_versions(
    scope: _versions.Scope, before: Tuple[Any, ...], records: List[Any], lengths: List[Dict[str, int]]
) -> None:
    """The scope (``before``, its ``state(True)``) and each record as before
    the segment (``lengths``: its versions per variable then)."""
    scope.put_back(before)
    for r, known in zip(records, lengths):
        for uid in list(r.versions):
            n = known.get(uid, 0)
            if n == 0:
                del r.versions[uid]
                del r.writes[uid]
            else:
                del r.versions[uid][n:]
                del r.writes[uid][n - 1 :]


def checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a step that reads and writes variables so that a tape keeps
    only its boundary: the step is run again in the backward pass.

    Inside an open ``AssignAwareTape``, each call of the wrapper runs ``fn``
    with the tape not recording, keeps a copy of every variable it touches
    (at its first touch) and records one op: from the versions of those
    variables at the call to the new versions of the variables it wrote and
    the floating-point tensors it returned. The backward pass puts the copies
    back, runs ``fn`` again under its own tape, and differentiates it.
    Values, gradients and ``None``-ness are those of the same calls without
    the wrapper. Outside a recording tape the wrapper just calls ``fn``.

    Tensors the tape watches that ``fn`` should differentiate must be passed
    as arguments (``checkpointed(fn)(x)``): a tensor ``fn`` closes over is a
    constant to it. ``fn`` must compute the same thing when run again from
    the same variables: see ``RecomputeError`` for what is refused.

    Args:
      fn: a callable, such as one inner training step (a forward pass, a
        plain tape's gradient and ``opt.apply_gradients``).

    Returns:
      A callable taking ``fn``'s positional arguments and returning what
      ``fn`` returns.

    Example:

    >>> w, lr = tf.Variable(2.0), tf.Variable(0.1)
    >>> step = checkpointed(lambda: w.assign_sub(lr * 2.0 * w))
    >>> with AssignAwareTape() as tape:
    ...     for _ in range(3):
    ...         _ = step()
    ...     loss = w * 1.0
    >>> round(float(tape.gradient(loss, lr)), 4)  # d(2 (1 - 2 lr)^3)/d lr
    -7.68
    """
    name = f"checkpointed({getattr(fn, '__name__', 'fn')})"

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        return _segment(name, fn, args)

    return call


def unroll(
    fn: Callable[[], Any], steps: int, checkpoint_every: Optional[int] = None, truncate: Optional[int] = None
) -> Any:
    """Calls ``fn`` ``steps`` times, in segments of ``checkpoint_every``
    steps that the tape keeps only at their boundaries.

    The carried state is found from the writes: the variables the steps
    write (weights, optimizer slots, counters, moving statistics), so ``fn``
    is the plain step, as it would be called in a loop. Each segment is one
    ``checkpointed`` call; the backward pass runs one segment at a time
    again, so the tape's memory grows like ``steps / checkpoint_every``
    checkpoints plus one segment's steps (about ``2 sqrt(steps)`` steps with
    the default). The result equals the loop without ``unroll``.

    Args:
      fn: a zero-argument step (see ``checkpointed`` for what it may do).
      steps: a Python int.
      checkpoint_every: steps per segment; default ``ceil(sqrt(steps))``
        (of the differentiated steps, with ``truncate``).
      truncate: differentiate only the last ``truncate`` steps: the steps
        before them run as under the tape's ``stop_recording()`` (their
        writes are new versions with no gradient path).

    Returns:
      What the last call of ``fn`` returned (None for zero steps).

    Raises:
      RecomputeError: ``steps`` is a tensor (the number of segments must be
        known when the tape records), or what ``checkpointed`` refuses.

    Example:

    >>> w, lr = tf.Variable(2.0), tf.Variable(0.1)
    >>> with AssignAwareTape() as tape:
    ...     _ = unroll(lambda: w.assign_sub(lr * 2.0 * w), steps=3, checkpoint_every=2)
    ...     loss = w * 1.0
    >>> round(float(tape.gradient(loss, lr)), 4)
    -7.68
    """
    if isinstance(steps, tensor_lib.Tensor) or not isinstance(steps, numbers.Integral):
        raise RecomputeError(
            f"unroll was given steps={steps!r}: it takes a Python int (the tape records one op per "
            "segment, so their number must be known while it records). Pass int(steps), or loop "
            "over checkpointed(fn) calls yourself."
        )
    if steps < 0 or (checkpoint_every is not None and checkpoint_every < 1) or (truncate is not None and truncate < 0):
        raise ValueError(f"unroll: steps ({steps}) and truncate must be >= 0, checkpoint_every >= 1")
    steps = int(steps)
    kept = steps if truncate is None else min(truncate, steps)
    result = None
    if steps > kept:
        result = _cut_steps(fn, steps - kept)
    every = checkpoint_every or max(1, math.ceil(math.sqrt(kept)))
    name = f"unroll({getattr(fn, '__name__', 'fn')})"
    done = 0
    while done < kept:
        n = min(every, kept - done)
        done += n
        result = _segment(name, functools.partial(_steps, fn, n), (), returns=done == kept)
    return result


def _steps(fn: Callable[[], Any], n: int) -> Any:
    result = None
    for _ in range(n):
        result = fn()
    return result


def _cut_steps(fn: Callable[[], Any], n: int) -> Any:
    """``n`` steps as under the tapes' ``stop_recording()``: every
    ``AssignAwareTape`` of the scope paused (a plain tape ``fn`` opens
    records, as it would there: ``record.stop_recording()`` would stop it)."""
    scopes = getattr(_registry._tls, "scopes", None)
    scope = _registry._enclosing_scope(scopes) if scopes else None
    paused = [r for r in scope.records if r.recording()] if scope is not None else []
    for r in paused:
        r.pause()
    try:
        return _steps(fn, n)
    finally:
        for r in reversed(paused):
            r.resume()
