"""tf.distribute: cross-replica updates of variables a replica's tape tracks.

Under ``MirroredStrategy`` each replica runs in a thread of its own, with its
own versions. A Keras optimizer step in replica context all-reduces the
gradients there (recorded on each replica's tape), then updates every
component of every variable in a cross-replica update (``merge_call``), in
the main thread while the replicas wait. Each component's update is run as
its replica (``_threads.acting_for``): a version on that replica's tapes,
whose gradient flows into that replica's arguments. The per-replica
meta-gradients then sum to the single-device gradient of the summed
objective.

An aggregated write (a ``MirroredVariable`` with an aggregation other than
NONE, written in replica context while a tape is open there) is taken on
TensorFlow's own path without ``merge_call`` (``aggregated_write``): the
value is all-reduced in the replica (recorded, with TensorFlow's gradient of
an all-reduce, the all-reduce of the upstream gradient), and each replica
writes the reduced value to its own component, a version on its own tape.
The components end as TensorFlow's path leaves them. Any other cross-replica
update (a ``merge_call`` of the user's own that updates an aggregated
variable) reduces its values outside every tape: refused, or cut by option.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf

from assigntape import _branches, _refusals, _registry, _threads, _versions
from assigntape._errors import ControlFlowWriteError, UntrackedWriteError
from assigntape._tf import (
    ALL_REDUCE_MERGE_FN,
    REPLICA_MERGE_CALL,
    V1_OPTIMIZER_FINISH,
    V1_OPTIMIZER_UPDATE,
    array_ops,
    context,
    distribute_lib,
    distribute_values,
    executing_eagerly,
    indexed_slices,
    math_ops,
    nest,
    ops,
    pywrap_tfe,
    tensor_lib,
)
from assigntape._wrapping import bind

__all__ = [
    "aggregated_write",
    "cross_replica_reduce",
    "distributed_update",
    "non_slot_update",
    "replica_thread_run",
    "watched_as_replica",
]


def replica_thread_run(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``mirrored_run._MirroredReplicaThread.run``: a replica thread, run as the
    replica it stands for when a ``merge_call`` starts it.

    A ``merge_call`` function may call ``call_for_each_replica`` itself (Keras
    3's ``LossScaleOptimizer`` unscales the gradients and steps its inner
    optimizer so): a second set of replica threads, while the first, whose
    tapes are open, wait in ``merge_call``. What each computes (the unscaled
    gradients, the learning rate, the update) is that replica's, so it runs
    as that replica (``_threads.acting_for``): on its versions, recorded on
    its tapes, and its own ``merge_call`` updates act for it as any
    cross-replica update does. A thread in another graph than its replica's
    tape (a ``tf.cond`` built in ``merge_call``, compiled) runs plainly; its
    writes are then refused by ``distributed_update``.
    """
    replicas = _threads.replica_scopes(instance.distribution, any_graph=True)
    scope = replicas.get(instance.replica_id)
    replica_context = None if scope is None else _waiting_replica_context(scope.thread)
    if scope is None or replica_context is None or scope.key is not (None if instance.in_eager else instance.graph):
        return wrapped(*args, **kwargs)
    main_fn, its_scope = instance.main_fn, scope

    def as_its_replica(*a: Any, **k: Any) -> Any:
        # In the replica's own ReplicaContext, not the one this thread made:
        # what it records (an all-reduce's gradient, which merge_calls through
        # the context it was made in) is differentiated in the replica's
        # thread, where only its own context may merge_call. The context keeps
        # no thread of its own: its merge_call pauses the calling thread.
        # (Its mode pushed, not the context entered: entering would keep this
        # thread's summary state on the context, for the replica to restore.)
        distribute_lib._push_per_thread_mode(replica_context._thread_context)
        try:
            with _threads.acting_for(its_scope, list(replicas.values())):
                return main_fn(*a, **k)
        finally:
            distribute_lib._pop_per_thread_mode()

    instance.main_fn = as_its_replica
    return wrapped(*args, **kwargs)


def watched_as_replica(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``tape._variables_override``, TensorFlow's resolver of the variables a
    read or write watches (``distribute_lib.get_local_results_or_value_container``):
    acting for a replica (``_threads.acting_for``), the variable's container,
    as in the replica's own context.

    A cross-replica update runs in the main thread in cross-replica context,
    where the resolver gives the component itself: the replica's tapes,
    recording there, would watch replica 1's component ``a/replica_1`` beside
    the ``MirroredVariable`` its own reads watched, and ``watched_variables()``
    would list the variable twice (replica 0's component and the container
    share a ``_unique_id``, so only the other replicas'). The container's
    ``handle`` there is the component's (the update's replica), so what the
    tape follows is the same."""
    if not _threads.acting():
        return wrapped(*args, **kwargs)
    variable = args[0] if args else kwargs["variable"]
    return [distribute_lib.get_strategy().extended.value_container(variable)]


def _waiting_replica_context(thread: int) -> Any:
    """The ``ReplicaContext`` whose ``merge_call`` the replica thread
    ``thread`` (its ident) is waiting in, else None."""
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code is REPLICA_MERGE_CALL:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def distributed_update(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``StrategyExtendedV2.update``: a cross-replica write of a distributed variable.

    It runs in cross-replica context (for MirroredStrategy, in the main thread,
    while the replica threads wait in ``merge_call``), where a replica's tape
    cannot see it. An update of an ``aggregation=NONE`` variable, which is how
    a Keras optimizer applies the gradients it all-reduced in replica context,
    is run component by component as its replica (``_threads.acting_for``):
    each component's write is a version on that replica's tapes, its value
    computed from that replica's (recorded) arguments. Any other update is
    refused while a replica's tape is open, or, if every such tape passed
    ``untracked_writes="cut"``, made a version with no gradient path on each.
    """
    arguments = bind(("var", "fn", "args", "kwargs", "group"), args, kwargs)
    var = arguments["var"]
    strategy = instance._container_strategy()
    if not (
        _versions.differentiable(var)
        and _threads.open_elsewhere()
        # Made on behalf of replicas with a tape open: some of this strategy's
        # replica threads are paused in merge_call (in whatever graph). Else it
        # is this thread's own write (a Keras step with no strategy beside
        # another thread's tape), which the write ops follow or refuse.
        and _threads.replica_scopes(strategy, any_graph=True)
    ):
        return wrapped(*args, **kwargs)
    replicas = _threads.replica_scopes(strategy)
    components = getattr(var, "values", ())
    aggregation = getattr(var, "aggregation", None)
    if (
        # TensorFlow applies an update to each component with that replica's
        # arguments, whatever the aggregation: for a NONE variable (how a Keras
        # optimizer applies the gradients it all-reduced on the replicas'
        # tapes) and for a SyncOnReadVariable (whose replica-context writes
        # never come here: the aggregation is for reads) that is all there is.
        (getattr(aggregation, "name", None) == "NONE" or isinstance(var, distribute_values.SyncOnReadVariable))
        and components
        and sorted(replicas) == list(range(len(components)))
    ):
        fn = _coefficients_per_replica(arguments["fn"])
        # Before any component is written: a value the update function holds
        # (its closure) that one replica's tape computed and another's cannot
        # follow is refused now, not after the first replicas' components are
        # updated.
        held = _held_tensors(fn)
        if held:
            merging = list(replicas.values())
            for replica in sorted(replicas):
                with _threads.acting_for(replicas[replica], merging):
                    _threads.refuse_foreign_inputs(components[replica], "a cross-replica update", held)

        def as_its_replica(component: Any, *a: Any, **k: Any) -> Any:
            replica = distribute_lib.get_update_replica_id()
            with _threads.acting_for(replicas[replica], list(replicas.values())):
                return fn(component, *a, **k)

        arguments["fn"] = as_its_replica
        return wrapped(**arguments)
    # Refused (or cut) whenever a tape is open in a replica, whether it has
    # read the variable yet or not: one that reads it later would read the
    # updated value and credit the version from before the update.
    message = _unmatched_update_message(var, aggregation, bool(components), bool(replicas))
    scopes = [replicas[i] for i in sorted(replicas)]
    if not components or sorted(replicas) != list(range(len(components))):
        # No way to name each replica's component: nothing to cut.
        raise UntrackedWriteError(message)
    _refusals.refuse_or_cut(scopes, var, "a cross-replica update", message)
    result = wrapped(*args, **kwargs)
    # untracked_writes="cut" on every tape: each replica's component gets a
    # new version with no gradient path, made as that replica, after the update.
    after = None if context.executing_eagerly() else _grouped(result)
    for replica, scope in zip(sorted(replicas), scopes):
        with _threads.acting_for(scope, scopes):
            _refusals.cut([scope], components[replica], "a cross-replica update", after)
    return result


# What works instead of an update no replica's tape can own: shared by the
# refusals of updates and of reductions to one device.
_ONE_COPY = (
    "The variable is one copy for all replicas (CentralStorageStrategy keeps it on one device), "
    "updated once in merge_call from the replicas' reduced values: no replica's tape can own "
    "that update. Differentiate the step in cross-replica context instead (the tape and the "
    "writes outside strategy.run, which works under CentralStorageStrategy), or use "
    "MirroredStrategy, whose optimizer steps in replica context are differentiated per replica."
)


def _unmatched_update_message(var: Any, aggregation: Any, has_components: bool, matched: bool) -> str:
    """Why a cross-replica update made for replicas with an open tape cannot
    be made a version on their tapes, and what works instead (``matched``:
    the replicas' tapes are in the graph being built here)."""
    head = (
        f"A cross-replica update of variable {var.name!r} (aggregation "
        f"{getattr(aggregation, 'name', aggregation)}), while AssignAwareTapes are open in the "
        "replicas: it cannot be made a version on their tapes, and reads after it would credit "
        "the version from before, a silently wrong gradient. "
    )
    if not has_components:
        return head + _ONE_COPY
    if not matched:
        return head + (
            "It is made inside a tf.cond or loop built in merge_call, where no replica's tape can "
            "be matched to each component: a compiled Keras 3 LossScaleOptimizer steps its inner "
            "optimizer there, a compiled dynamic tf_keras LossScaleOptimizer updates its loss "
            "scale there. Run the step eagerly, where it is differentiated: strategy.run of a "
            "Python function, not a tf.function (or tf.config.run_functions_eagerly(True) for "
            "code you do not own); or use an optimizer without loss scaling inside the tape."
        )
    if getattr(aggregation, "name", None) == "NONE" or isinstance(var, distribute_values.SyncOnReadVariable):
        return head + (
            "It is made in merge_call with fewer replicas with an open tape than components: "
            "open the tape in every replica."
        )
    return head + (
        "Its value is aggregated outside the replicas' tapes (a merge_call of your own that "
        "updates a MirroredVariable whose aggregation is not NONE). Inside the tape, write per "
        "replica instead: aggregation=NONE (each replica writes its own component) or "
        "synchronization=ON_READ, with assign / assign_sub, and all-reduce the values yourself "
        "(tf.distribute.get_replica_context().all_reduce). Keras optimizer steps in replica "
        "context under MirroredStrategy are differentiated."
    )


def non_slot_update(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``StrategyExtendedV1.update_non_slot``: a ``tf.compat.v1.train``
    optimizer's update of its own variables (Adam's powers of the betas), on
    each device in turn, in merge_call. Each device's update runs as its
    replica, like a component's in ``distributed_update``, with the
    optimizer's coefficients computed again as that replica."""
    replicas = _threads.replica_scopes(instance._container_strategy()) if _threads.open_elsewhere() else {}
    if not replicas:
        return wrapped(*args, **kwargs)
    arguments = bind(("colocate_with", "fn", "args", "kwargs", "group"), args, kwargs)
    fn, merging = arguments["fn"], list(replicas.values())

    def as_its_replica(*a: Any, **k: Any) -> Any:
        replica = distribute_lib.get_update_replica_id()
        if replica not in replicas:
            raise UntrackedWriteError(
                "A non-slot update (update_non_slot) on a device no replica with an open "
                "AssignAwareTape runs on: it cannot be made a version of any replica's tape."
            )
        with _threads.acting_for(replicas[replica], merging):
            if getattr(fn, "__code__", None) is V1_OPTIMIZER_FINISH:
                a[0]._prepare()  # finish(optimizer, update_ops)
            return fn(*a, **k)

    arguments["fn"] = as_its_replica
    return wrapped(**arguments)


def _coefficients_per_replica(fn: Any) -> Any:
    """A tf_keras legacy (or ``tf.compat.v1.train``) optimizer's update
    function, made to compute its coefficients as the replica whose component
    it updates.

    ``OptimizerV2._distributed_apply`` closes its update function over
    ``apply_state``: the coefficients (learning rate, powers of the betas,
    ...) that the replica whose ``merge_call`` function is used, the first,
    computed on its own tape. Every replica's component would be updated with
    them, out of reach of the other replicas' tapes. With ``apply_state``
    empty, each ``_resource_apply_*`` computes them again
    (``_fallback_apply_state``, which every tf_keras optimizer calls), in the
    update of each component: as its replica, on its replica's tapes, from
    the same values. Any other function is returned as it is.
    """
    code = getattr(fn, "__code__", None)
    if code is V1_OPTIMIZER_UPDATE:
        # tf.compat.v1.train: the coefficients are the optimizer's attributes,
        # set by ``_prepare()`` once in merge_call, outside every replica's
        # tape: set them again, as the replica.
        optimizer = fn.__closure__[code.co_freevars.index("self")].cell_contents

        def prepared(*args: Any, **kwargs: Any) -> Any:
            optimizer._prepare()
            return fn(*args, **kwargs)

        return prepared
    if (
        code is None
        or "apply_state" not in code.co_freevars
        or not fn.__qualname__.endswith("_distributed_apply.<locals>.apply_grad_to_update_var")
        or not fn.__module__.startswith("tf_keras.")
    ):
        return fn
    cells = tuple(
        types.CellType({}) if name == "apply_state" else cell for name, cell in zip(code.co_freevars, fn.__closure__)
    )
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, cells)


def cross_replica_reduce(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``StrategyExtendedV2.reduce_to`` / ``batch_reduce_to`` in a ``merge_call``,
    of values the replicas' tapes recorded.

    The reduction runs in the main thread, outside every replica's tape
    (tf_keras legacy optimizers and ``tf.compat.v1.train`` optimizers sum the
    replicas' gradients this way): each replica's component of the result is
    linked, on that replica's tapes, to the value that replica gave, with
    TensorFlow's gradient of an all-reduce (the same reduction of the upstream
    gradients, in replica context). ``ReplicaContext.all_reduce`` reduces here
    too, under a custom gradient of its own that the tapes follow already: left
    alone. A reduction to one device, or of ``IndexedSlices``, is refused.
    """
    replicas = _threads.replica_scopes(instance._container_strategy()) if _threads.open_elsewhere() else {}
    if not replicas:
        return wrapped(*args, **kwargs)
    batched = wrapped.__name__ == "batch_reduce_to"
    if batched:
        arguments = bind(("reduce_op", "value_destination_pairs", "options"), args, kwargs)
        values = [value for value, _ in arguments["value_destination_pairs"]]
        destinations = [destination for _, destination in arguments["value_destination_pairs"]]
    else:
        arguments = bind(("reduce_op", "value", "destinations", "options"), args, kwargs)
        values, destinations = [arguments["value"]], [arguments["destinations"]]
    recorded = [_recorded_parts(value, replicas) for value in values]
    sparse = any(isinstance(part, indexed_slices.IndexedSlices) for parts in recorded for part in parts)
    # ReplicaContext.all_reduce's own custom gradient covers dense values only.
    if not any(recorded) or (not sparse and _inside_all_reduce()):
        return wrapped(*args, **kwargs)
    reduce_op = arguments["reduce_op"]
    if isinstance(reduce_op, str):
        reduce_op = tf.distribute.ReduceOp(reduce_op.upper())
    merging = list(replicas.values())
    # Before anything is reduced: forward mode cannot follow the link below.
    _refuse_tangents(wrapped.__name__, recorded, replicas, merging)
    results = wrapped(*args, **kwargs)
    linked = []
    for parts, destination, result in zip(recorded, destinations, results if batched else [results]):
        components = getattr(result, "values", None)
        if not parts:
            linked.append(result)
            continue
        if not isinstance(components, tuple) or len(components) != len(parts):
            raise UntrackedWriteError(
                f"A cross-replica reduction ({wrapped.__name__}, in merge_call) toward "
                f"{getattr(destination, 'name', destination)!r} of values an AssignAwareTape "
                "open in the replicas recorded, to one device: its result cannot be linked to "
                "each replica's tape, so anything computed from it would lose its gradient path, "
                "a silently wrong gradient. A reduction of your own: reduce in replica context "
                "instead (tf.distribute.get_replica_context().all_reduce). An optimizer's step: " + _ONE_COPY
            )
        new = []
        for replica, (part, component) in enumerate(zip(parts, components)):
            with _threads.acting_for(replicas[replica], merging):
                if isinstance(part, indexed_slices.IndexedSlices):
                    new.append(_all_gathered(parts, replica, component, reduce_op))
                else:
                    new.append(_all_reduced(part, component, reduce_op))
        linked.append(distribute_values.Mirrored(tuple(new)))
    return linked if batched else linked[0]


def _refuse_tangents(name: str, recorded: List[List[Any]], replicas: Dict[int, Any], merging: List[Any]) -> None:
    """Refuses a reduction in a ``merge_call`` (the user's own, or a tf_keras
    legacy or ``tf.compat.v1.train`` optimizer's) of values a replica's
    ``ForwardAccumulator`` has a tangent for.

    The link ``cross_replica_reduce`` makes is a reverse-mode rule (the
    all-reduce of the upstream gradients, in replica context); an accumulator
    open in the replica differentiates it forward here, in the cross-replica
    context, where each replica's result would need the tangents of every
    replica's value, which each replica's own accumulators hold apart.
    TensorFlow's own forward mode gives no tangent there (a None jvp), a
    silently missing term: refused instead, before anything is reduced."""
    for replica, scope in sorted(replicas.items()):
        tensors = [
            t
            for parts in recorded
            if parts
            for t in nest.flatten(parts[replica], expand_composites=True)
            if isinstance(t, tensor_lib.Tensor)
        ]
        with _threads.acting_for(scope, merging):
            has_tangent = bool(tensors) and bool(pywrap_tfe.TFE_Py_PackJVPs(tensors)[1])
        if has_tangent:
            raise ControlFlowWriteError(
                f"A ForwardAccumulator open in replica {replica} has a tangent for a value reduced "
                f"across replicas in a merge_call ({name}: a merge_call of your own, or the step of a "
                "tf_keras legacy or tf.compat.v1.train optimizer, which sums its gradients so), while "
                "an AssignAwareTape is open there: forward mode cannot follow a reduction made in the "
                "cross-replica context (TensorFlow's own gives no tangent there, a silently missing "
                "term). Reduce in replica context instead (tf.distribute.get_replica_context()."
                "all_reduce, which forward mode follows eagerly; a Keras 3 optimizer sums its "
                "gradients so), or take the gradient with the tape alone (reverse mode follows this "
                "reduction). Nothing was reduced."
            )


def _inside_all_reduce() -> bool:
    """Whether this reduction is ``ReplicaContext.all_reduce``'s own (its
    ``merge_call`` function is on the stack)."""
    frame: Optional[types.FrameType] = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code is ALL_REDUCE_MERGE_FN:
            return True
        frame = frame.f_back
    return False


def _recorded_parts(value: Any, replicas: Dict[int, Any]) -> List[Any]:
    """A per-replica value's parts if a replica's tapes recorded its part, else []."""
    parts = getattr(value, "values", None)
    if not isinstance(parts, tuple) or sorted(replicas) != list(range(len(parts))):
        return []
    for replica, part in enumerate(parts):
        tensors = [t for t in nest.flatten(part, expand_composites=True) if isinstance(t, tensor_lib.Tensor)]
        if tensors and _threads.recorded_by(replicas[replica], tensors):
            return list(parts)
    return []


def _all_reduced(part: Any, component: Any, reduce_op: Any) -> Any:
    """``component`` (the reduction's result on a replica's device), recorded
    as a function of ``part`` (the value that replica gave) with TensorFlow's
    gradient of an all-reduce."""

    @tf.custom_gradient
    def reduced(x: Any) -> Any:
        def grad(upstream: Any) -> Any:
            return distribute_lib.get_replica_context().all_reduce(reduce_op, upstream)

        return tf.identity(component), grad

    return reduced(part)


def _all_gathered(parts: List[Any], replica: int, component: Any, reduce_op: Any) -> Any:
    """The reduction of ``IndexedSlices`` (every replica's rows, one after
    another, divided by their number for MEAN), built here on the device of
    ``component`` (TensorFlow's result for ``replica``), recorded as a function of
    that replica's rows: the gradient of its rows is its segment of the
    same reduction of every replica's upstream gradient."""
    # Python numbers where the shapes are known: the gradient function may run
    # in another graph (the gradient of a cond around the step), where a
    # tensor of this one would be an unfed placeholder.
    sizes = [p.values.shape[0] if p.values.shape[0] is not None else array_ops.shape(p.values)[0] for p in parts]
    start = sum(sizes[:replica]) if replica else 0
    with ops.device(component.values.device):
        rows = array_ops.concat([p.values for p in parts], 0)
        indices = array_ops.concat([p.indices for p in parts], 0)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            rows = rows / math_ops.cast(len(parts), rows.dtype)

    @tf.custom_gradient
    def gathered(x: Any) -> Any:
        def grad(upstream: Any) -> Any:
            upstream = ops.convert_to_tensor(upstream)  # dense rows, to slice
            total = distribute_lib.get_replica_context().all_reduce(reduce_op, upstream)
            return total[start : start + sizes[replica]]

        return array_ops.identity(rows), grad

    return indexed_slices.IndexedSlices(gathered(parts[replica].values), indices, component.dense_shape)


def _held_tensors(fn: Any, depth: int = 3) -> List[Any]:
    """The tensors a function holds: in its closure and, for a
    ``functools.partial``, its bound arguments, looking into lists, tuples and
    dicts (``depth`` levels)."""
    found: List[Any] = []

    def visit(x: Any, level: int) -> None:
        if isinstance(x, tensor_lib.Tensor):
            found.append(x)
        elif level > 0 and isinstance(x, (list, tuple)):
            for item in x:
                visit(item, level - 1)
        elif level > 0 and isinstance(x, dict):
            for item in x.values():
                visit(item, level - 1)

    if isinstance(fn, functools.partial):
        visit(list(fn.args) + list(fn.keywords.values()), depth)
        fn = fn.func
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        visit(contents, depth)
    return found


def _grouped(result: Any) -> Any:
    """One op that runs after every op and tensor in ``result`` (the update's)."""
    parts = [
        x for x in nest.flatten(result, expand_composites=True) if isinstance(x, (tensor_lib.Tensor, ops.Operation))
    ]
    return tf.group(*parts)


def aggregated_write(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``values._on_write_update_replica``: a replica-context write of an
    ``ON_WRITE`` distributed variable (see the module's docstring)."""
    arguments = bind(("var", "update_fn", "value"), args, kwargs)
    var, value = arguments["var"], arguments["value"]
    aggregation = getattr(getattr(var, "aggregation", None), "name", "NONE")
    if (
        aggregation == "NONE"
        or not _versions.differentiable(var)
        or _branches.call_context() is None  # no tape open in this replica
        or not isinstance(value, tensor_lib.Tensor)  # a number, IndexedSlices: TensorFlow's path
    ):
        return wrapped(*args, **kwargs)
    replica = distribute_lib.get_replica_context()
    if aggregation == "ONLY_FIRST_REPLICA":
        # The first replica's value, everywhere: a sum in which the others add zeros.
        first = tf.cast(tf.equal(replica.replica_id_in_sync_group, 0), value.dtype)
        reduced = replica.all_reduce(tf.distribute.ReduceOp.SUM, value * first)
    else:
        reduced = replica.all_reduce(getattr(tf.distribute.ReduceOp, aggregation), value)
    update_kwargs = {k: v for k, v in kwargs.items() if k not in ("var", "update_fn", "value")}
    return arguments["update_fn"](var._get_on_device_or_primary(), reduced, **update_kwargs)


def replica_all_reduce(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``ReplicaContext.all_reduce`` (which Keras's optimizers sum the
    replicas' gradients with) in a graph, of values a ``ForwardAccumulator``
    of this replica has a tangent for, while a tape of ours is open here:
    TensorFlow's forward mode gives a graph all-reduce across replicas no
    tangent (plain TensorFlow's jvp is 0 where eager gives the value), so
    every jvp through it would miss the all-reduced value's: refused. Eagerly
    it is right; with one replica (no strategy) it is the value itself."""
    if executing_eagerly() or not _registry.open_here() or getattr(instance, "num_replicas_in_sync", 1) <= 1:
        return wrapped(*args, **kwargs)
    value = kwargs.get("value", args[1] if len(args) > 1 else None)
    tensors = [t for t in nest.flatten(value, expand_composites=True) if isinstance(t, tensor_lib.Tensor)]
    if tensors and pywrap_tfe.TFE_Py_PackJVPs(tensors)[1]:
        raise ControlFlowWriteError(
            "A ForwardAccumulator has a tangent for a value all-reduced across replicas "
            "(ReplicaContext.all_reduce, as an optimizer's step under MirroredStrategy sums its "
            "gradients) inside a tf.function, where an AssignAwareTape is open: TensorFlow's "
            "forward mode gives a graph all-reduce no tangent, so the jvp would miss it, a "
            "silently wrong answer. Run the step eagerly or use reverse mode."
        )
    return wrapped(*args, **kwargs)
