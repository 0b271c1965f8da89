"""Gradient rules for the write ops the tape differentiates: a plain dict, by op.

Writes are intercepted at the op wrappers (``gen_*_ops``), so one rule serves
every path to an op: ``v.assign``, ``tf.compat.v1.assign``, ``tf.raw_ops``,
checkpoint restore, Keras. A rule has two forms of the same write, built from
one description (the ``COMBINES`` table below):

* ``value(old, args)``: the functional rewrite, the variable's whole new value
  from plain TensorFlow ops. Inside a ``tf.cond`` branch or a loop body this is
  what TensorFlow's own gradient differentiates.
* ``prepare(var, old, args)``: for the eager tape (and a tape's own graph), a
  ``Write``: the inputs of the op recorded on the tape (the previous version
  first when the write keeps part of it) and the backward function that routes
  the gradient arriving at the new version back to them. The backward functions
  are vector-Jacobian products of ``value``, made of differentiable ops only
  (higher order is promised) and with TensorFlow's conventions: the conjugate
  for complex dtypes, gradients summed over broadcast dimensions, and written
  parts of the previous version masked with zeros, never ``g - g`` (which is
  NaN where ``g`` is infinite).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from assigntape import _fused
from assigntape._errors import DuplicateIndicesError
from assigntape._tf import (
    array_ops,
    check_ops,
    context,
    control_flow_util,
    gen_array_ops,
    gen_resource_variable_ops,
    indexed_slices,
    math_ops,
    ops,
    record,
    resource_variable_ops,
    tensor_util,
)

__all__ = [
    "Write",
    "Rule",
    "RULES",
    "COMBINES",
    "UNDIFFERENTIABLE_PREFIXES",
    "REFUSED_WRITES",
    "NOT_VARIABLE_WRITES",
    "VERSION_SPECIFIC",
    "refused",
    "gather_rows",
    "identity_backward",
]

Args = Dict[str, Any]


class Write(NamedTuple):
    inputs: List[Any]  # recorded inputs: [previous version, *values] or [*values]
    backward: Callable[[Any], List[Any]]
    reads_old: bool
    checks: List[Any]  # graph-mode assertions the write must wait for


class Rule(NamedTuple):
    resource_arg: str  # the name of the op wrapper's resource argument
    value_args: Tuple[str, ...]  # arguments converted to the variable's dtype
    prepare: Callable[[Any, Any, Args], Write]  # (var, old handle, args) -> Write
    value: Callable[[Any, Args], Any]  # (old value, args) -> new value


def _dense(g: Any) -> Any:
    if isinstance(g, indexed_slices.IndexedSlices):
        return ops.convert_to_tensor(g)
    return g


def identity_backward(g: Any) -> List[Any]:
    """The backward function of a version that is its value unchanged (a
    recorded identity). A read through tf.gather gives IndexedSlices; the
    ops of the write rules want tensors."""
    return [_dense(g)]


def _negate(g: Any) -> Any:
    # Gradients that reach a version through tf.gather / embedding lookups are
    # IndexedSlices; keep them sparse.
    if isinstance(g, indexed_slices.IndexedSlices):
        return indexed_slices.IndexedSlices(math_ops.negative(g.values), g.indices, g.dense_shape)
    return math_ops.negative(g)


def _unbroadcast(g: Any, like: Any, lead: int = 0) -> Any:
    """Sums ``g`` down to the shape of ``like``, which was broadcast to ``g``'s.
    Their first ``lead`` dimensions are the same (a scatter's rows, one per
    index: never broadcast)."""
    like = ops.convert_to_tensor(like)
    if g.shape.is_fully_defined() and g.shape == like.shape:
        return g
    g_rest, like_rest = g.shape[lead:], like.shape[lead:]
    pad = g_rest.rank - like_rest.rank if g_rest.rank is not None and like_rest.rank is not None else -1
    if g_rest.is_fully_defined() and like_rest.is_fully_defined() and pad >= 0 and not (pad and lead):
        # Known shapes: the axes in Python, and no shape arithmetic in the
        # graph, which XLA cannot compile where the number of rows is dynamic
        # (indices from tf.unique, the sparse path of the legacy Adam family).
        padded = [1] * pad + like_rest.as_list()
        axes = [lead + i for i, (n, m) in enumerate(zip(g_rest.as_list(), padded)) if m == 1 and n != 1]
        summed = math_ops.reduce_sum(g, axes, keepdims=True) if axes else g
        # (With pad, ``lead`` is 0: ``like``'s whole shape is known.)
        return array_ops.reshape(summed, like_rest) if pad else summed
    g_shape, like_shape = array_ops.shape(g), array_ops.shape(like)
    _, axes = gen_array_ops.broadcast_gradient_args(g_shape, like_shape)
    return array_ops.reshape(math_ops.reduce_sum(g, axes), like_shape)


def _broadcast(value: Any, like: Any) -> Any:
    value = ops.convert_to_tensor(value)
    if value.shape.is_fully_defined() and value.shape == like.shape:
        return value
    return array_ops.broadcast_to(value, array_ops.shape(like))


# -- how a write combines the previous rows with the written values -------------
#
# name -> (forward(rows, u), vjp(rows, u, g) -> (g_rows, g_u)); ``u`` already has
# the shape of ``rows``. The VJPs are TensorFlow's own for the same ops (Mul,
# RealDiv/Div, and Select for min/max, a tie going to the previous value).
Combine = Tuple[Callable[[Any, Any], Any], Optional[Callable[[Any, Any, Any], Tuple[Any, Any]]]]


def _mul_vjp(rows: Any, u: Any, g: Any) -> Tuple[Any, Any]:
    return g * math_ops.conj(u), g * math_ops.conj(rows)


def _div_vjp(rows: Any, u: Any, g: Any) -> Tuple[Any, Any]:
    cu = math_ops.conj(u)
    return g / cu, g * (-math_ops.conj(rows) / cu / cu)


def _select_vjp(keep_old: Callable[[Any, Any], Any]) -> Callable[[Any, Any, Any], Tuple[Any, Any]]:
    def vjp(rows: Any, u: Any, g: Any) -> Tuple[Any, Any]:
        keep, zeros = keep_old(rows, u), array_ops.zeros_like(g)
        return array_ops.where(keep, g, zeros), array_ops.where(keep, zeros, g)

    return vjp


def _ge(rows: Any, u: Any) -> Any:
    return math_ops.greater_equal(rows, u)


def _le(rows: Any, u: Any) -> Any:
    return math_ops.less_equal(rows, u)


COMBINES: Dict[str, Combine] = {
    # ``update`` ignores the rows: no VJP through them.
    "update": (lambda rows, u: u, None),
    "mul": (lambda rows, u: rows * u, _mul_vjp),
    "div": (lambda rows, u: rows / u, _div_vjp),
    "max": (lambda rows, u: array_ops.where(_ge(rows, u), rows, u), _select_vjp(_ge)),
    "min": (lambda rows, u: array_ops.where(_le(rows, u), rows, u), _select_vjp(_le)),
}


# -- whole-variable writes ---------------------------------------------------


def _whole(kind: str) -> Rule:
    sign = {"assign": 0, "assign_add": 1, "assign_sub": -1}[kind]

    def value(old: Any, args: Args) -> Any:
        return args["value"] if sign == 0 else old + args["value"] if sign > 0 else old - args["value"]

    def prepare(var: Any, old: Any, args: Args) -> Write:
        if sign == 0:
            return Write([args["value"]], lambda g: [g], False, [])
        if sign > 0:
            return Write([old, args["value"]], lambda g: [g, g], True, [])
        return Write([old, args["value"]], lambda g: [g, _negate(g)], True, [])

    return Rule("resource", ("value",), prepare, value)


# -- scatter writes ------------------------------------------------------------
#
# Both index forms are handled as scatter_nd: ``scatter_*(indices)`` addresses
# rows, which is ``scatter_nd_*(indices[..., None])``.


def _linear(nd_indices: Any, var: Any) -> Any:
    """Each index row as one integer, to find rows written twice."""
    depth = nd_indices.shape[-1]
    dims = math_ops.cast(array_ops.shape(var)[:depth], nd_indices.dtype)
    strides = math_ops.cumprod(dims, exclusive=True, reverse=True)
    return math_ops.reduce_sum(array_ops.reshape(nd_indices, [-1, depth]) * strides, axis=1)


def gather_rows(x: Any, idx: Any) -> Any:
    """``tf.gather_nd(x, idx)``, written with ``tf.gather``: TensorFlow's forward
    mode fails on ``gather_nd`` (the jvp cannot take its ``IndexedSlices``
    gradient), and rules must work under a ``ForwardAccumulator`` too."""
    depth = idx.shape[-1]
    shape = array_ops.shape(x)
    flat = array_ops.reshape(x, array_ops.concat([[-1], shape[depth:]], 0))
    rows = array_ops.gather(flat, _linear(idx, x))
    outer = math_ops.cast(array_ops.shape(idx)[:-1], shape.dtype)
    return array_ops.reshape(rows, array_ops.concat([outer, shape[depth:]], 0))


def _repeated(var: Any, nd_indices: Any) -> Any:
    """For each index row: whether another row writes the same position. (Of
    ops XLA compiles: not UniqueWithCounts.)"""
    flat = _linear(nd_indices, var)
    _, position = array_ops.unique(flat)
    counts = math_ops.unsorted_segment_sum(array_ops.ones_like(position), position, array_ops.size(flat))
    return math_ops.greater(array_ops.gather(counts, position), 1)


def _in_xla() -> bool:
    return not context.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def _nan_where(repeated: Any, g_rows: Any) -> Any:
    """``g_rows`` with NaN in the rows whose index repeats."""
    trailing = array_ops.ones_like(array_ops.shape(g_rows)[array_ops.rank(repeated) :])
    mask = array_ops.reshape(repeated, array_ops.concat([array_ops.shape(repeated), trailing], 0))
    mask = array_ops.broadcast_to(mask, array_ops.shape(g_rows))
    nan = array_ops.fill(array_ops.shape(g_rows), math_ops.cast(float("nan"), g_rows.dtype))
    return array_ops.where(mask, nan, g_rows)


def _static_rows(nd_indices: Any) -> Optional[np.ndarray]:
    """The index rows, if they are known while tracing: constants, also in
    the row form ``_nd`` gives ``scatter_*`` indices (their ExpandDims)."""
    value = tensor_util.constant_value(nd_indices)
    op = nd_indices.op
    if value is None and op.type == "ExpandDims":
        inner, axis = tensor_util.constant_value(op.inputs[0]), tensor_util.constant_value(op.inputs[1])
        if inner is not None and axis is not None:
            value = np.expand_dims(inner, int(axis))
    return None if value is None else np.reshape(value, [-1, value.shape[-1]])


def _no_duplicates(var: Any, nd_indices: Any, op_name: str) -> List[Any]:
    """Refuses a write whose result or gradient depends on duplicate order.

    Eagerly it raises ``DuplicateIndicesError``; in a graph it returns an
    assertion for the write to wait for. XLA drops assertions, so there
    indices known while tracing are refused while tracing, and for indices
    known only at run time it returns nothing: the write must make its own
    gradient NaN where its indices repeat (``_repeated``), as a write in a
    ``tf.cond`` branch or loop body does (``_control_flow``)."""
    message = (
        f"{op_name} on variable {var.name!r} has duplicate indices. With duplicates "
        "the written value depends on the order TensorFlow applies them (update) or "
        "combines them, and the tape differentiates only writes with unique "
        "indices. Combine the updates per index first (tf.math.unsorted_segment_*), "
        "or write with scatter_add / scatter_nd_add, which sum duplicates."
    )
    if _in_xla():
        rows = _static_rows(nd_indices)
        if rows is not None and len(np.unique(rows, axis=0)) != len(rows):
            raise DuplicateIndicesError(
                message + " (Refused while tracing: XLA compiles this function and drops the run-time check.)"
            )
        return []
    flat = _linear(nd_indices, var)
    unique = array_ops.size(array_ops.unique(flat)[0])
    if context.executing_eagerly():
        if int(unique) != int(array_ops.size(flat)):
            raise DuplicateIndicesError(message)
        return []
    return [check_ops.assert_equal(unique, array_ops.size(flat), message=message)]


def _recorded_rows(var: Any, old: Any, idx: Any) -> Any:
    """The written rows of the previous version, recorded as a read of it, so
    that a second derivative reaches the previous version through them. Only
    the indices and the shape are kept for the backward pass."""
    # A partial write's previous version must be watched, as a read of it would be.
    resource_variable_ops.variable_accessed(var)
    with record.stop_recording():
        rows = gather_rows(gen_resource_variable_ops.read_variable_op(old, var.dtype), idx)
        shape = gen_resource_variable_ops.variable_shape(old, out_type=idx.dtype)

    def backward(g: Any) -> List[Any]:
        return [array_ops.scatter_nd(idx, _dense(g), shape)]

    record.record_operation("AssigntapeGatherRows", [rows], [old], backward)
    return rows


def _nd(indices: Any, nd_form: bool) -> Any:
    indices = ops.convert_to_tensor(indices)
    return indices if nd_form else array_ops.expand_dims(indices, -1)


def _scatter(combine: str, nd_form: bool) -> Rule:
    op_name = ("ResourceScatterNd" if nd_form else "ResourceScatter") + combine.capitalize()
    additive = combine in ("add", "sub")
    forward, vjp = COMBINES["update" if additive else combine]

    def value(old: Any, args: Args) -> Any:
        idx = _nd(args["indices"], nd_form)
        rows = gather_rows(old, idx)
        u = _broadcast(args["updates"], rows)
        if additive:
            scatter = gen_array_ops.tensor_scatter_add if combine == "add" else gen_array_ops.tensor_scatter_sub
            return scatter(old, idx, u)
        return gen_array_ops.tensor_scatter_update(old, idx, forward(rows, u))

    def prepare(var: Any, old: Any, args: Args) -> Write:
        idx = _nd(args["indices"], nd_form)
        updates = args["updates"]
        if updates.shape.rank == 0:
            # A scalar update (the raw ops broadcast it to every written row),
            # given to the op already broadcast: in a graph, TensorFlow's
            # optimizer (constant folding with arithmetic simplification)
            # otherwise folds the backward pass's rows to a scalar when the
            # update comes from a written variable, and the scatter of the
            # gradient fails.
            known = idx.shape[:-1].concatenate(var.shape[idx.shape[-1] :]) if idx.shape.rank else None
            with record.stop_recording():  # a shape: nothing to differentiate, forward or back
                # Static where known: XLA needs a constant shape for a
                # broadcast differentiated in a loop (BroadcastGradientArgs).
                rows_shape = (
                    known.as_list()
                    if known is not None and known.is_fully_defined()
                    else array_ops.concat(
                        [
                            array_ops.shape(idx, out_type=idx.dtype)[:-1],
                            gen_resource_variable_ops.variable_shape(old, out_type=idx.dtype)[idx.shape[-1] :],
                        ],
                        0,
                    )
                )
            updates = args["updates"] = array_ops.broadcast_to(updates, rows_shape)
        checks = [] if additive else _no_duplicates(var, idx, op_name)
        rows = None if additive or vjp is None else _recorded_rows(var, old, idx)
        # Under XLA the run-time duplicate check is gone: make the gradient NaN
        # where indices repeat, which cannot pass for a gradient.
        repeated = (
            None
            if additive or not _in_xla()
            else array_ops.reshape(
                _repeated(var, array_ops.reshape(idx, [-1, idx.shape[-1]])), array_ops.shape(idx)[:-1]
            )
        )

        # The dimensions of the written rows, one per index, which the ops never broadcast.
        lead = 0 if idx.shape.rank is None else idx.shape.rank - 1

        def backward(g: Any) -> List[Any]:
            g = _dense(g)
            g_rows = gather_rows(g, idx)
            if additive:
                return [g, _unbroadcast(g_rows if combine == "add" else -g_rows, updates, lead)]
            if vjp is None or rows is None:  # update: the written rows forget the old ones
                g_kept, g_u = array_ops.zeros_like(g_rows), g_rows
            else:
                g_kept, g_u = vjp(rows, _broadcast(updates, rows), g_rows)
            if repeated is not None:
                g_kept, g_u = _nan_where(repeated, g_kept), _nan_where(repeated, g_u)
            return [gen_array_ops.tensor_scatter_update(g, idx, g_kept), _unbroadcast(g_u, updates, lead)]

        return Write([old, updates], backward, True, checks)

    return Rule("ref" if nd_form else "resource", ("updates",), prepare, value)


# -- slice writes --------------------------------------------------------------

_MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")


def _slice_args(args: Args) -> Tuple[Any, Any, Any, Dict[str, Any]]:
    return args["begin"], args["end"], args["strides"], {m: args.get(m, 0) for m in _MASKS}


def _slice_value(old: Any, args: Args) -> Any:
    begin, end, strides, masks = _slice_args(args)
    part = array_ops.strided_slice(old, begin, end, strides, **masks)
    return gen_array_ops.tensor_strided_slice_update(old, begin, end, strides, _broadcast(args["value"], part), **masks)


def _slice_assign(var: Any, old: Any, args: Args) -> Write:
    begin, end, strides, masks = _slice_args(args)
    value = args["value"]

    def backward(g: Any) -> List[Any]:
        g = _dense(g)
        g_part = array_ops.strided_slice(g, begin, end, strides, **masks)
        g_old = gen_array_ops.tensor_strided_slice_update(g, begin, end, strides, array_ops.zeros_like(g_part), **masks)
        return [g_old, _unbroadcast(g_part, value)]

    return Write([old, value], backward, True, [])


# -- the registry ----------------------------------------------------------------

RULES: Dict[str, Rule | _fused.Kernel] = {
    "AssignVariableOp": _whole("assign"),
    "AssignAddVariableOp": _whole("assign_add"),
    "AssignSubVariableOp": _whole("assign_sub"),
    "ResourceStridedSliceAssign": Rule("ref", ("value",), _slice_assign, _slice_value),
}
for _combine in ("update", "add", "sub", "mul", "div", "min", "max"):
    RULES["ResourceScatter" + _combine.capitalize()] = _scatter(_combine, nd_form=False)
for _combine in ("update", "add", "sub", "min", "max"):
    RULES["ResourceScatterNd" + _combine.capitalize()] = _scatter(_combine, nd_form=True)

# The fused optimizer kernels of tf.compat.v1.train and tf_keras.optimizers.legacy
# write a variable and its slots in one op: their rules are ``_fused.Kernel``s
# (the functional form of every value the kernel writes), not ``Rule``s, and
# ``_writes.fused_write`` applies them.
RULES.update(_fused.KERNELS)

# The fused kernels' prefixes: a kernel without a rule in ``_fused`` (one a future
# TensorFlow adds) writes variables the tape does not differentiate, and is refused.
UNDIFFERENTIABLE_PREFIXES = ("ResourceApply", "ResourceSparseApply")

del _combine


# -- every op that takes a resource: differentiated, refused, or not a write ----
#
# tests/test_write_op_coverage.py walks TensorFlow's op registry and fails on any
# op with a DT_RESOURCE input that none of these tables names: RULES
# (differentiated), refused() (REFUSED_WRITES, and UNDIFFERENTIABLE_PREFIXES
# without a rule) or NOT_VARIABLE_WRITES. A write op added by a future
# TensorFlow then fails CI instead of writing a tracked variable behind the
# tape's back, which would give a silently wrong gradient. The tables name exact
# ops, so every new op is looked at by a person (the one exception is the
# fused-kernel prefixes, whose new members without a rule are refused wherever
# their wrapper lives; the test checks that).

# Ops that write a variable (a ``tensorflow::Var``) and have no rule: refused
# with UntrackedWriteError when the variable is one a tape tracks. Where
# TensorFlow generates a Python wrapper, ``_patches`` wraps it; every one of them
# is also found in function graphs by ``_functions._writes_anything``.
REFUSED_WRITES: frozenset[str] = frozenset(
    {
        # Writes the concatenation of its (padded) inputs; an XLA-only kernel,
        # so it runs only under jit_compile (or on TPU).
        "AssignVariableXlaConcatND",
        # Increments an integer variable. Integer variables carry no gradient,
        # so the refusal never fires in practice; listed because it writes.
        "ResourceCountUpTo",
        # Advance a tf.random.Generator's state variable. The kernels take only
        # int64 state, which carries no gradient: plain TensorFlow in practice.
        "RngReadAndSkip",
        "RngSkip",
        "StatefulRandomBinomial",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulUniform",
        "StatefulUniformFullInt",
        "StatefulUniformInt",
        # Run a compiled program that may write the variables it is given. No
        # Python wrapper: they appear only in graphs (XLA's and the TPU
        # rewrites), where the graph scan refuses them.
        "XlaLaunch",
        "_TPUReplicate",
        "TPUReshardVariables",  # rewrites the variables' TPU layout in place
        # The same, with their resource inputs typed by an attribute
        # (``list(type)``), so the registry test does not see them as taking
        # resources; listed so that the graph scan refuses them too.
        "_XlaRun",
        "TPUExecute",
        "TPUExecuteAndUpdateVariables",
    }
)


# Listed ops that only some supported TensorFlow versions register (2.16 has
# InitializeTRTResource; later versions add the other two).
VERSION_SPECIFIC: frozenset[str] = frozenset({"InitializeTRTResource", "GlobalShuffleDataset", "IteratorGetModelProto"})


def refused(op_type: str) -> bool:
    """Whether an op writes variables the tape refuses (it has no rule)."""
    if op_type in REFUSED_WRITES:
        return True
    return op_type.startswith(UNDIFFERENTIABLE_PREFIXES) and op_type not in RULES


# Ops with a DT_RESOURCE input that never write a variable's value, by group:
# reason -> exact op names. The groups from "iterators" on take other kinds of
# resource: their kernels look the handle up as their own kind, and a variable's
# handle fails that lookup instead of being written.
NOT_VARIABLE_WRITES: Dict[str, frozenset[str]] = {
    "initializes a TensorRT engine cache resource": frozenset({"InitializeTRTResource"}),
    "read a variable's value, shape or initialisation state": frozenset(
        {
            "ReadVariableOp",
            "_ReadVariablesOp",
            "ReadVariableXlaSplitND",
            "ResourceGather",
            "ResourceGatherNd",
            "VariableShape",
            "VarIsInitializedOp",
        }
    ),
    "a variable's lifetime or handle, not its value (a destroyed variable fails loudly on its next read)": frozenset(
        {"DestroyResourceOp", "DisableCopyOnRead", "IsResourceHandleRefCounting", "MakeWeakResourceHandle"}
    ),
    "compiles an XLA cluster against the variables' current values; _XlaRun writes": frozenset({"_XlaCompile"}),
    "iterators, datasets and their seed generators, caches and thread pools": frozenset(
        {
            "CacheDatasetV2",
            "DataServiceDataset",
            "DataServiceDatasetV2",
            "DataServiceDatasetV3",
            "DataServiceDatasetV4",
            "DeleteIterator",
            "DeleteMemoryCache",
            "DeleteMultiDeviceIterator",
            "DeleteRandomSeedGenerator",
            "DeleteSeedGenerator",
            "DeserializeIterator",
            "ExperimentalIteratorGetDevice",
            "ExperimentalSetStatsAggregatorDataset",
            "ExperimentalStatsAggregatorSummary",
            "ExperimentalThreadPoolDataset",
            "GlobalShuffleDataset",
            "IteratorGetDevice",
            "IteratorGetModelProto",
            "IteratorGetNext",
            "IteratorGetNextAsOptional",
            "IteratorGetNextSync",
            "IteratorToStringHandle",
            "MakeIterator",
            "MultiDeviceIteratorGetNextFromShard",
            "MultiDeviceIteratorInit",
            "MultiDeviceIteratorToStringHandle",
            "RandomDatasetV2",
            "SerializeIterator",
            "SetStatsAggregatorDataset",
            "ShuffleAndRepeatDatasetV2",
            "ShuffleDatasetV2",
            "ShuffleDatasetV3",
            "StatsAggregatorSetSummaryWriter",
            "StatsAggregatorSummary",
            "ThreadPoolDataset",
        }
    ),
    "lookup tables": frozenset(
        {
            "InitializeTableFromDataset",
            "InitializeTableFromTextFileV2",
            "InitializeTableV2",
            "LookupTableExportV2",
            "LookupTableFindV2",
            "LookupTableImportV2",
            "LookupTableInsertV2",
            "LookupTableRemoveV2",
            "LookupTableSizeV2",
        }
    ),
    "queues, readers, stacks and TensorArrays": frozenset(
        {
            "FakeQueue",
            "QueueCloseV2",
            "QueueDequeueManyV2",
            "QueueDequeueUpToV2",
            "QueueDequeueV2",
            "QueueEnqueueManyV2",
            "QueueEnqueueV2",
            "QueueIsClosedV2",
            "QueueSizeV2",
            "ReaderNumRecordsProducedV2",
            "ReaderNumWorkUnitsCompletedV2",
            "ReaderReadUpToV2",
            "ReaderReadV2",
            "ReaderResetV2",
            "ReaderRestoreStateV2",
            "ReaderSerializeStateV2",
            "StackCloseV2",
            "StackPopV2",
            "StackPushV2",
            "TensorArrayCloseV3",
            "TensorArrayConcatV3",
            "TensorArrayGatherV3",
            "TensorArrayGradV3",
            "TensorArrayGradWithShape",
            "TensorArrayReadV3",
            "TensorArrayScatterV3",
            "TensorArraySizeV3",
            "TensorArraySplitV3",
            "TensorArrayWriteV3",
        }
    ),
    "conditional gradient accumulators (tf.compat.v1 SyncReplicasOptimizer)": frozenset(
        {
            "ResourceAccumulatorApplyGradient",
            "ResourceAccumulatorNumAccumulated",
            "ResourceAccumulatorSetGlobalStep",
            "ResourceAccumulatorTakeGradient",
        }
    ),
    "summary writers": frozenset(
        {
            "CloseSummaryWriter",
            "CreateSummaryDbWriter",
            "CreateSummaryFileWriter",
            "FlushSummaryWriter",
            "ImportEvent",
            "WriteAudioSummary",
            "WriteGraphSummary",
            "WriteHistogramSummary",
            "WriteImageSummary",
            "WriteRawProtoSummary",
            "WriteScalarSummary",
            "WriteSummary",
        }
    ),
    "boosted-trees ensembles and quantile streams": frozenset(
        {
            "BoostedTreesCenterBias",
            "BoostedTreesCreateEnsemble",
            "BoostedTreesCreateQuantileStreamResource",
            "BoostedTreesDeserializeEnsemble",
            "BoostedTreesExampleDebugOutputs",
            "BoostedTreesFlushQuantileSummaries",
            "BoostedTreesGetEnsembleStates",
            "BoostedTreesPredict",
            "BoostedTreesQuantileStreamResourceAddSummaries",
            "BoostedTreesQuantileStreamResourceDeserialize",
            "BoostedTreesQuantileStreamResourceFlush",
            "BoostedTreesQuantileStreamResourceGetBucketBoundaries",
            "BoostedTreesSerializeEnsemble",
            "BoostedTreesTrainingPredict",
            "BoostedTreesUpdateEnsemble",
            "BoostedTreesUpdateEnsembleV2",
            "IsBoostedTreesEnsembleInitialized",
            "IsBoostedTreesQuantileStreamResourceInitialized",
        }
    ),
    "collective ordering tokens and communicators": frozenset(
        {
            "CollectiveAllToAllV2",
            "CollectiveAllToAllV3",
            "CollectiveGatherV2",
            "CollectiveReduceScatterV2",
            "CollectiveReduceV2",
            "CollectiveReduceV3",
        }
    ),
    "RPC clients, servers and futures": frozenset(
        {
            "DeleteRpcFutureResource",
            "RpcCall",
            "RpcCheckStatus",
            "RpcGetValue",
            "RpcServerRegister",
            "RpcServerStart",
        }
    ),
    "mutexes (tf.CriticalSection)": frozenset({"MutexLock"}),
    "TensorFlow's own test ops, on a stub resource (framework/test_ops.cc)": frozenset(
        {"ResourceCreateOp", "ResourceInitializedOp", "ResourceUsingOp"}
    ),
}
