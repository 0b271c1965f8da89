"""What a checkpointed segment's first run notes and refuses.

The touch log (``TouchLog``) stands in for a scope's ``owners`` while a
segment runs: each variable the segment touches is noted there, and its value
copied at its first touch (the checkpoint). The refusals (``Refusals``) are
what a re-run in the backward pass could not reproduce: a variable created in
the step, a stateful op whose state no variable holds, a watched tensor the
step closes over.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from assigntape import _registry, _versions
from assigntape._errors import RecomputeError
from assigntape._tf import (
    UnliftedInitializerVariable,
    context,
    dtypes,
    gen_resource_variable_ops,
    op_callbacks,
    op_def_registry,
    ops,
    pywrap_tfe,
    record,
    tensor_lib,
    tensor_util,
)

# Stateful ops whose side effect changes no value the step computes with, or
# that TensorFlow declares stateful while their result is a function of their
# inputs (a check, an uninitialized buffer, a device's index, a constant hint).
_HARMLESS = frozenset(
    [
        *("Assert", "Print", "PrintV2", "Timestamp", "EagerPyFunc", "PyFunc", "DebugIdentityV2", "DebugIdentityV3"),
        *("CheckNumerics", "CheckNumericsV2", "Empty", "DeviceIndex", "GuaranteeConst", "DeepCopy"),
        *("_ParallelConcatStart", "StatelessRandomGetAlg", "IsTensorFloat32Enabled", "DatasetToSingleElement"),
        *("SleepOp", "SleepIdentityOp", "SyncDevice"),
    ]
)
# Stateful ops that draw random numbers from a state in their kernel: refused
# also where the rule below would let them pass (a dataset of random numbers).
_DRAWS = frozenset(["RandomDataset", "ExperimentalRandomDataset", "Skipgram"])
# Ops that call a function traced before.
_CALLS = frozenset(["StatefulPartitionedCall", "PartitionedCall"])
_RESOURCE = 20  # types_pb2.DT_RESOURCE
_STRING = 7  # types_pb2.DT_STRING: the handle of a queue, reader or TensorArray of TF1
_VARIANT = 21  # types_pb2.DT_VARIANT: a dataset


@functools.lru_cache(maxsize=None)
def _hidden_state_op(op_type: str) -> bool:
    """A primitive op whose result depends on a state no variable holds and
    that a re-run would not reproduce: stateful (op_def), and not

    - an op that runs functions (``If``, ``While``, ``Case``, a call, a
      dataset's map): stateful only through its bodies, which
      ``_hidden_state_in`` looks into;
    - a resource's op (it takes or makes one): which resource it takes is
      ``Refusals.foreign_resource``'s question (a variable, whose value the
      checkpoint holds, or one made in the step, made again by the re-run);
      a resource made in the step that draws a random seed is
      ``_draws_seed``'s;
    - an op that makes a dataset or a TF1 handle (a variant or string output
      with no other input than values: the re-run makes the same one);
    - ``_HARMLESS``.

    What is left draws from a per-op state in the kernel (the random ops,
    candidate samplers, ``_DRAWS``) or reaches outside the step (a
    ``Recv``, a collective, a file read), which the re-run may not see again.
    (The stateless random ops Keras' SeedGenerator feeds are not stateful.)"""
    op_def = op_def_registry.get(op_type)
    if op_def is None or not op_def.is_stateful or op_type in _HARMLESS:
        return False
    if op_type in _DRAWS:
        return True
    if any(a.type in ("func", "list(func)") for a in op_def.attr):
        return False
    args = [*op_def.input_arg, *op_def.output_arg]
    if any(a.type == _RESOURCE for a in args):
        return False
    return not any(a.type in (_STRING, _VARIANT) for a in op_def.output_arg)


@functools.lru_cache(maxsize=None)
def _seed_slots(op_type: str) -> Tuple[Optional[Tuple[int, int]], bool]:
    """Where ``op_type`` takes TensorFlow's pair of seeds (``seed`` and
    ``seed2``): their input indices, and whether it takes them as attrs."""
    op_def = op_def_registry.get(op_type)
    if op_def is None:
        return None, False
    names = [a.name for a in op_def.input_arg]
    if "seed" in names and "seed2" in names:
        return (names.index("seed"), names.index("seed2")), False
    return None, {"seed", "seed2"} <= {a.name for a in op_def.attr}


def _draws_seed(seeds: Sequence[Any]) -> bool:
    """Whether an op given ``seeds`` (its seed and seed2, None where not
    known when the op is built) draws a random seed: TensorFlow's convention
    for both zero (no op seed and no global seed), in a shuffle's seed
    generator, a RandomShuffleQueue, a dataset's shuffle. A seed the re-run
    gets otherwise (an op seed counted from the global seed, whose counter
    moves on) is found by the re-run check's order-sensitive fingerprint."""
    return all(s is not None and int(s) == 0 for s in seeds)


@functools.lru_cache(maxsize=None)
def _stateful(op_type: str) -> bool:
    op_def = op_def_registry.get(op_type)
    return op_def is None or bool(op_def.is_stateful)


def _ignores_foreign(op_type: str, has_outputs: bool) -> bool:
    """An op that may take a resource made before the step and changes no
    value the step computes with: a deletion (of an object collected during
    the step), a summary written to a file."""
    return (
        op_type in _HARMLESS or op_type.startswith(("Delete", "Destroy")) or ("Summary" in op_type and not has_outputs)
    )


def _text(name: Any) -> str:
    """An op's type or attr name as TensorFlow's eager callbacks give it (bytes)."""
    return name.decode() if isinstance(name, bytes) else str(name)


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


class TouchLog(Dict[int, Any]):
    """A scope's ``owners`` while a segment runs: every served handle is set
    here, so the first setting of each variable is its first touch in the
    segment, before any write of it (a write fetches the handle it writes
    through first). There its value is copied. Nothing here may raise (the
    handle descriptor calls it from TensorFlow's C++ code): an error is kept
    for the segment to raise."""

    def __init__(self, base: Dict[int, Any], graph: Any = None) -> None:
        super().__init__(base)
        self.touched: Dict[str, Tuple[Any, Any]] = {}
        self.error: Optional[BaseException] = None
        # The segment's graph (None: eager): the copy is made there, also at
        # a first touch inside a tf.cond branch or loop body the step builds
        # (whose tensors the segment's graph cannot reach). There it runs
        # before the control-flow op, which is built after its bodies and
        # ordered after the read by the automatic control dependencies: the
        # value at the segment's start, as the first touch would see it.
        self.graph = graph

    def __setitem__(self, key: int, var: Any) -> None:
        super().__setitem__(key, var)
        self.note(var)

    def note_captures(self, handles: Sequence[Any]) -> None:
        """A function the step calls is about to run with ``handles`` as its
        captured inputs: each variable among them noted now, its copy taken
        before the call, as at a read. (The op callback learns of the call
        only after it, eagerly: a variable the function changes by an op
        that is no write, a tf.random.Generator's or a Keras SeedGenerator's
        state, would be copied changed, and its re-run would draw other
        numbers.)"""
        for handle in handles:
            if isinstance(handle, tensor_lib.Tensor) and handle.dtype == dtypes.resource:
                var = _variable_of(handle, self)
                if var is not None:
                    self.note(var)

    def note(self, var: Any) -> None:
        """``var`` touched: at its first touch, its value copied."""
        uid = var.__dict__.get("_unique_id")
        if uid is None or uid in self.touched:
            return
        self.touched[uid] = (var, None)
        try:
            if self.graph is None or ops.get_default_graph() is self.graph:
                self.touched[uid] = (var, read(var))
            else:
                with self.graph.as_default():
                    self.touched[uid] = (var, read(var))
        except BaseException as error:  # noqa: B036 - kept, raised by the segment
            if self.error is None:
                self.error = error


def resume(records: Sequence[Any]) -> None:
    """Resumes each of ``records`` that is paused, last first (an interrupt
    may have come before the pause of some)."""
    for r in reversed(records):
        if not r.recording():
            r.resume()


def leave(stack: contextlib.ExitStack[Any]) -> None:
    """Exits what ``stack`` entered and has not exited yet, with the
    exception being handled, if any: from a ``finally``, so that an
    internal tape or scope is never left open, also when an interrupt comes
    as a ``with`` block ends, before its exit is called (which no ``with``
    can prevent). Called again after an interrupt, it exits what is left."""
    stack.__exit__(*sys.exc_info())


def remove_callback(callback: Any) -> None:
    """Removes an op callback, if it was added (an interrupt may have come first)."""
    if callback in context.context().op_callbacks:
        op_callbacks.remove_op_callback(callback)


def read(var: Any) -> Any:
    """The variable's value now, through its own handle, on no tape."""
    with record.stop_recording():
        return gen_resource_variable_ops.read_variable_op(var.__dict__["_handle"], var.dtype)


def assign(var: Any, value: Any) -> None:
    with record.stop_recording():
        gen_resource_variable_ops.assign_variable_op(var.__dict__["_handle"], value)


def is_float(dtype: Any) -> bool:
    return bool(dtype.is_floating or dtype.is_complex)


class Refusals:
    """What the first run of a segment must not do: create a variable, run a
    random op whose state no variable holds, or compute with a tensor that
    the paused tapes watch and that was not given as an argument (a tensor
    the step closes over: the segment would cut its gradient). Each is a
    ``RecomputeError``, raised at the op (before it runs, eagerly); a
    variable created, once the step has returned (``deferred``)."""

    def __init__(self, name: str, paused: List[Any], args: Sequence[Any], log: TouchLog, key: Any) -> None:
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
        # The name of the first variable the step created (``creator``).
        self.created: Optional[str] = None
        # The unique ids of the variables the step created in a tf.function's
        # first trace, whose value its first touch took before TensorFlow
        # initialized them: kept as made, not put back to that.
        self.created_ids: Set[str] = set()
        # Whether this segment refused the step (``refuse``, ``deferred``; a
        # failed copy, ``TouchLog.error``): then the step is undone. (Not the
        # error itself: AutoGraph may raise a refusal from a function the step
        # traces as a new error of the same type.)
        self.refused = False

    def creator(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        """Creates the variable and notes it: refused once the step has
        returned (``deferred``), not here, in the middle of what creates it
        (a Keras optimizer's ``build``, a ``tf.function``'s first trace),
        which would leave that object half made for good."""
        var = next_creator(**kwargs)
        uid = getattr(var, "_unique_id", None)
        if uid is not None and isinstance(var, UnliftedInitializerVariable):
            self.created_ids.add(uid)
        if self.created is None:
            self.created = str(kwargs.get("name") or getattr(var, "name", None) or "unnamed")
        return var

    def deferred(self) -> Optional[RecomputeError]:
        """The refusal of a variable created in the step (``creator``), if any."""
        if self.created is None:
            return None
        self.refused = True
        error: RecomputeError = RecomputeError(
            f"{self.name} created a variable ({self.created}) inside a checkpointed step: its re-run "
            "in the backward pass would create another. Create every variable before the step "
            "(build the model, and the optimizer: opt.build(model.trainable_variables)). The "
            "variables it created are kept (the step's writes undone): the step called again "
            "finds them made."
        )
        return error

    def callback(
        self, op_type: str, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None, graph: Any = None
    ) -> Any:
        # (returns ``outputs``: TensorFlow hands the next callback in its list
        # what this one returns, None for "unchanged" only to the op itself)
        if not self.running_here():
            return outputs
        if graph is None:  # (a graph's ops: looked at once it is built, ``scan``)
            op_type = _text(op_type)
            found = _hidden_state_in(op_type, (), set())  # (a function: its name)
            if found is not None:
                self.refuse_hidden_state(found)
            resources = [t for t in inputs or () if isinstance(t, tensor_lib.Tensor) and t.dtype == dtypes.resource]
            self.foreign_resource(op_type, [t for t in resources if not self.made(t)], bool(outputs))
            slots, in_attrs = _seed_slots(op_type)
            named = {_text(k): v for k, v in zip(attrs[::2], attrs[1::2])} if in_attrs and attrs else {}
            seeds = [inputs[i].numpy() for i in slots] if slots else [named.get("seed"), named.get("seed2")]
            if (slots or in_attrs) and _draws_seed(seeds):
                self.refuse_seed(op_type)
        if graph is not self.key:
            return outputs  # a function traced meanwhile: its own graph
        for t in inputs or ():
            if isinstance(t, tensor_lib.Tensor) and t.dtype == dtypes.resource:
                # A variable a called tf.function reads through the handle it
                # captured: not served, so noted here (eagerly after the call:
                # noted before it, ``TouchLog.note_captures``, where the call
                # is made through the function's ``_call_flat``).
                var = _variable_of(t, self.log)
                if var is not None:
                    self.log.note(var)
        outside = [t for t in inputs or () if float_tensor(t) and not self.made(t)]
        if outside and self.paused:  # (the re-run: its own tape watches all)
            self._refuse_watched(op_type, outside)
        for t in outputs or ():
            if isinstance(t, tensor_lib.Tensor):
                self.inside.add(_key(t))
        return outputs

    def refuse(self, message: str) -> RecomputeError:
        """The refusal to raise, noted as this segment's."""
        self.refused = True
        error: RecomputeError = RecomputeError(message)
        return error

    def running_here(self) -> bool:
        """Whether the op is the segment's: its scope is this thread's (or
        the one this thread acts for, ``_threads.acting_for``). TensorFlow's
        list of op callbacks is shared: MirroredStrategy's replica threads
        take the list of the thread that started them, so each replica's
        segment sees the others' ops, and the cross-replica update's."""
        scopes: Dict[Any, Any] = getattr(_registry._tls, "scopes", None) or {}
        return any(scope.owners is self.log for scope in scopes.values())

    def made(self, t: Any) -> bool:
        """``t`` was given to the step or made by it."""
        return _key(t) in self.inside or (isinstance(t, ops.EagerTensor) and t._id >= self.first_id)

    def foreign_resource(self, op_type: str, resources: List[Any], has_outputs: bool) -> None:
        """Refuses ``op_type`` on a resource (of ``resources``: those not
        made in the step) that is not a variable's: a queue, table, iterator
        or seed generator made before the step, whose state no checkpoint
        holds (the re-run would see it changed, or wait on an empty queue)."""
        if not _stateful(op_type.split(" ")[0]) or _ignores_foreign(op_type, has_outputs):
            return  # (an op that is not stateful changes no resource: an identity of a handle)
        for t in resources:
            if _variable_of(t, self.log) is None:
                raise self.refuse(
                    f"{self.name} ran the op {op_type} on a resource made before the step that no "
                    "variable holds (a queue, a lookup table, an iterator, a seed generator): its "
                    "state changes as the step runs, so the re-run in the backward pass would see "
                    "another state (another element, an updated entry) or wait forever on an "
                    "emptied queue: a silently different gradient, or a hang. Take the values "
                    "outside the step and pass them in as tensors (checkpointed(step)(q.dequeue()), "
                    "checkpointed(step)(next(it)), a table's lookup), or keep the state in a variable."
                )

    def refuse_seed(self, op_type: str) -> None:
        raise self.refuse(
            f"{self.name} ran the op {op_type} with no seed (seed = seed2 = 0: TensorFlow draws a "
            "random one): its re-run in the backward pass would draw another (another shuffle "
            "order), a silently different gradient. Give it an op seed "
            "(dataset.shuffle(n, seed=1), tf.queue.RandomShuffleQueue(..., seed=1)), or shuffle "
            "outside the step and pass the batch in."
        )

    def refuse_hidden_state(self, found: str) -> None:
        raise self.refuse(
            f"{self.name} ran the stateful op {found}, whose result depends on a state no variable "
            "holds (a random op's or a candidate sampler's kernel state, a value received from "
            "outside the step): its re-run "
            "in the backward pass would get other values, a silently different gradient. Draw from "
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
            if found is not None:
                self.refuse_hidden_state(f"{found} ({op.name})")
            # (a resource from outside: a capture, whose placeholder may be new)
            origins = [_origin(t) for t in op.inputs if t.dtype == dtypes.resource]
            foreign = [t for t in origins if t.op.type == "Placeholder" or id(t.op) not in inside]
            self.foreign_resource(f"{op.type} ({op.name})", foreign, bool(op.outputs))
            slots, in_attrs = _seed_slots(op.type)
            if slots:
                seeds = [tensor_util.constant_value(op.inputs[i]) for i in slots]
            else:
                seeds = [op.get_attr("seed"), op.get_attr("seed2")] if in_attrs else []
            if seeds and _draws_seed(seeds):
                self.refuse_seed(f"{op.type} ({op.name})")
            if op.type in _CALLS:
                # A variable a called function reads through its captures: no
                # graph op callback sees the call, nor (the tapes paused) does
                # TensorFlow's note of the function's variables, which the
                # re-run's tape gets. Noted now (a function that writes is
                # inlined or refused: what it only reads has the same value
                # after the step as at the call).
                for t in op.inputs:
                    var = _variable_of(t, self.log) if t.dtype == dtypes.resource else None
                    if var is not None:
                        self.log.note(var)
            # (a call of a function, which no graph op callback sees, takes
            # what the function captures as inputs: the closes-over refusal)
            outside = [t for t in op.inputs if float_tensor(t) and id(t.op) not in inside and not self.made(t)]
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
            raise self.refuse(
                f"{self.name}: its op {op_type} takes a tensor that the tape differentiates and the "
                "step closes over: a segment would cut its gradient. Pass it as an argument, "
                "checkpointed(fn)(tensor), or read it from a variable."
            )


def _variable_of(handle: Any, log: TouchLog) -> Optional[Any]:
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


def _origin(t: Any) -> Any:
    """A graph's resource tensor, back through the identities it passed
    (a strategy's, a function's): the handle as made or captured."""
    while t.op.type in ("Identity", "IdentityN") and t.op.inputs:
        t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
    return t


def _key(t: Any) -> int:
    """A tensor's identity while the segment runs: an eager tensor's
    never-reused ``_id``, a graph tensor's ``id`` (its graph keeps it)."""
    found: int = t._id if isinstance(t, ops.EagerTensor) else id(t)
    return found


def float_tensor(x: Any) -> bool:
    return isinstance(x, tensor_lib.Tensor) and x.dtype != dtypes.resource and is_float(x.dtype)
