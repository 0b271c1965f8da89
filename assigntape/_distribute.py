"""tf.distribute: cross-replica updates of variables a replica's tape tracks.

Under ``MirroredStrategy`` each replica runs in a thread of its own, with its
own versions. A Keras optimizer step in replica context all-reduces the
gradients there (recorded on each replica's tape), then updates every
component of every variable in a cross-replica update (``merge_call``), in
the main thread while the replicas wait. Each component's update is run as
its replica (``_versions.acting_for``): a version on that replica's tapes,
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
from typing import Any, Callable, List

import tensorflow as tf

from assigntape import _versions
from assigntape._errors import UntrackedWriteError
from assigntape._tf import context, distribute_lib, distribute_values, nest, ops, tensor_lib
from assigntape._wrapping import bind

__all__ = ["distributed_update"]


def distributed_update(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``StrategyExtendedV2.update``: a cross-replica write of a distributed variable.

    It runs in cross-replica context (for MirroredStrategy, in the main thread,
    while the replica threads wait in ``merge_call``), where a replica's tape
    cannot see it. An update of an ``aggregation=NONE`` variable, which is how
    a Keras optimizer applies the gradients it all-reduced in replica context,
    is run component by component as its replica (``_versions.acting_for``):
    each component's write is a version on that replica's tapes, its value
    computed from that replica's (recorded) arguments. Any other update is
    refused while a replica's tape is open, or, if every such tape passed
    ``untracked_writes="cut"``, made a version with no gradient path on each.
    """
    arguments = bind(("var", "fn", "args", "kwargs", "group"), args, kwargs)
    var = arguments["var"]
    if not (_versions.differentiable(var) and _versions.open_elsewhere()):
        return wrapped(*args, **kwargs)
    replicas = _versions.replica_scopes()
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
        fn = arguments["fn"]
        # Before any component is written: a value the update function holds
        # (its closure) that one replica's tape computed and another's cannot
        # follow is refused now, not after the first replicas' components are
        # updated (tf_keras legacy optimizers hold the first replica's
        # coefficients there).
        held = _held_tensors(fn)
        if held:
            merging = list(replicas.values())
            for replica in sorted(replicas):
                with _versions.acting_for(replicas[replica], merging):
                    _versions.refuse_foreign_inputs(components[replica], "a cross-replica update", held)

        def as_its_replica(component: Any, *a: Any, **k: Any) -> Any:
            replica = distribute_lib.get_update_replica_id()
            with _versions.acting_for(replicas[replica], list(replicas.values())):
                return fn(component, *a, **k)

        arguments["fn"] = as_its_replica
        return wrapped(**arguments)
    # Refused (or cut) whenever a tape is open in a replica, whether it has
    # read the variable yet or not: one that reads it later would read the
    # updated value and credit the version from before the update.
    message = (
        f"A cross-replica update of variable {var.name!r} (aggregation "
        f"{getattr(aggregation, 'name', aggregation)}), while an AssignAwareTape is open "
        "in a replica: its value is aggregated outside the replicas' tapes (merge_call), "
        "so reads after it would credit the version from before, a silently wrong "
        "gradient. Such updates come from writes in replica context to a "
        "MirroredVariable whose aggregation is not NONE. Inside the tape, write per "
        "replica instead: aggregation=NONE (each replica writes its own component) or "
        "synchronization=ON_READ, with assign / assign_sub, and all-reduce the values "
        "yourself (tf.distribute.get_replica_context().all_reduce); Keras optimizer "
        "steps in replica context work."
    )
    scopes = [replicas[i] for i in sorted(replicas)]
    if not components or sorted(replicas) != list(range(len(components))):
        # No way to name each replica's component: nothing to cut.
        raise UntrackedWriteError(message)
    _versions.refuse_or_cut(scopes, var, "a cross-replica update", message)
    result = wrapped(*args, **kwargs)
    # untracked_writes="cut" on every tape: each replica's component gets a
    # new version with no gradient path, made as that replica, after the update.
    after = None if context.executing_eagerly() else _grouped(result)
    for replica, scope in zip(sorted(replicas), scopes):
        with _versions.acting_for(scope, scopes):
            _versions.cut([scope], components[replica], "a cross-replica update", after)
    return result


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
    parts = [x for x in nest.flatten(result, expand_composites=True) if isinstance(x, (tensor_lib.Tensor, ops.Operation))]
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
        or _versions.call_context() is None  # no tape open in this replica
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

