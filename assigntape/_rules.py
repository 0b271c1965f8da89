"""Gradient rules for the write ops the tape differentiates: a plain dict, by op.

Writes are intercepted at the op wrappers (``gen_*_ops``), so one rule serves
every path to an op: ``v.assign``, ``tf.compat.v1.assign``, ``tf.raw_ops``,
checkpoint restore, Keras. A rule turns the op's arguments into a ``Write``: the
inputs of the op recorded on the tape (the previous version first when the write
keeps part of it) and the backward function that routes the gradient arriving
at the new version back to them.

Every rule agrees with the functional rewrite of its write:
``assign`` -> value; ``assign_add`` / ``assign_sub`` -> old +- delta; scatter
writes -> ``tf.tensor_scatter_nd_update`` / ``_add`` / ``_sub`` / ``_min`` /
``_max`` (and the matching product and quotient); slice writes ->
``tf.tensor_scatter_nd_update`` of the slice.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional

from tensorflow.python.eager import context, record
from tensorflow.python.framework import dtypes, indexed_slices, ops
from tensorflow.python.ops import (
    array_ops,
    check_ops,
    gen_array_ops,
    gen_resource_variable_ops,
    math_ops,
)

from assigntape._errors import DuplicateIndicesError

__all__ = ["Write", "OpRule", "RULES", "BRANCH_VALUES", "UNDIFFERENTIABLE_PREFIXES"]


class Write(NamedTuple):
    inputs: List[Any]  # recorded inputs: [previous version, *values] or [*values]
    backward: Callable[[Any], List[Any]]
    reads_old: bool
    checks: List[Any]  # graph-mode assertions the write must wait for


class OpRule(NamedTuple):
    resource_arg: str  # the name of the op wrapper's resource argument
    value_args: tuple  # arguments converted to the variable's dtype
    prepare: Callable[[Any, Any, Dict[str, Any]], Write]  # (var, old handle, args)


def _dense(g: Any) -> Any:
    if isinstance(g, indexed_slices.IndexedSlices):
        return ops.convert_to_tensor(g)
    return g


def _negate(g: Any) -> Any:
    # Gradients that reach a version through tf.gather / embedding lookups are
    # IndexedSlices; keep them sparse.
    if isinstance(g, indexed_slices.IndexedSlices):
        return indexed_slices.IndexedSlices(math_ops.negative(g.values), g.indices, g.dense_shape)
    return math_ops.negative(g)


# -- whole-variable writes ---------------------------------------------------


def _assign(var: Any, old: Any, args: Dict[str, Any]) -> Write:
    return Write([args["value"]], lambda g: [g], False, [])


def _assign_add(var: Any, old: Any, args: Dict[str, Any]) -> Write:
    return Write([old, args["value"]], lambda g: [g, g], True, [])


def _assign_sub(var: Any, old: Any, args: Dict[str, Any]) -> Write:
    return Write([old, args["value"]], lambda g: [g, _negate(g)], True, [])


# -- scatter writes ------------------------------------------------------------
#
# Both index forms are handled as scatter_nd: ``scatter_*(indices)`` addresses
# rows, which is ``scatter_nd_*(indices[..., None])``.


def _sum_to(g: Any, like: Any) -> Any:
    """Sums a gradient down to the shape of ``like`` (updates may broadcast)."""
    if like.shape.rank == 0 and g.shape.rank != 0:
        return math_ops.reduce_sum(g)
    return g


def _linear(nd_indices: Any, var: Any) -> Any:
    """Each index row as one integer, to find rows written twice."""
    depth = nd_indices.shape[-1]
    dims = math_ops.cast(array_ops.shape(var)[:depth], nd_indices.dtype)
    strides = math_ops.cumprod(dims, exclusive=True, reverse=True)
    return math_ops.reduce_sum(array_ops.reshape(nd_indices, [-1, depth]) * strides, axis=1)


def _no_duplicates(var: Any, nd_indices: Any, op_name: str) -> List[Any]:
    """Refuses a write whose result or gradient depends on duplicate order."""
    flat = _linear(nd_indices, var)
    unique = array_ops.size(array_ops.unique(flat)[0])
    message = (
        f"{op_name} on variable {var.name!r} has duplicate indices. With duplicates "
        "the written value depends on the order TensorFlow applies them (update) or "
        "combines them, and the tape differentiates only writes with unique "
        "indices. Combine the updates per index first (tf.math.unsorted_segment_*), "
        "or write with scatter_add / scatter_nd_add, which sum duplicates."
    )
    if context.executing_eagerly():
        if int(unique) != int(array_ops.size(flat)):
            raise DuplicateIndicesError(message)
        return []
    return [check_ops.assert_equal(unique, array_ops.size(flat), message=message)]


def _rows_of(var: Any, old: Any, nd_indices: Any) -> Any:
    """The touched part of the previous version, as a constant for the backward."""
    with record.stop_recording():
        value = gen_resource_variable_ops.read_variable_op(old, var.dtype)
        return array_ops.gather_nd(value, nd_indices)


def _scatter(combine: str, nd_form: bool) -> Callable[[Any, Any, Dict[str, Any]], Write]:
    op_name = ("ResourceScatterNd" if nd_form else "ResourceScatter") + combine.capitalize()

    def prepare(var: Any, old: Any, args: Dict[str, Any]) -> Write:
        indices = ops.convert_to_tensor(args["indices"])
        idx = indices if nd_form else array_ops.expand_dims(indices, -1)
        updates = args["updates"]
        checks: List[Any] = []
        rows: Optional[Any] = None
        if combine not in ("add", "sub"):
            checks = _no_duplicates(var, idx, op_name)
        if combine in ("mul", "div", "min", "max"):
            rows = _rows_of(var, old, idx)

        def backward(g: Any) -> List[Any]:
            g = _dense(g)
            g_rows = array_ops.gather_nd(g, idx)
            if combine == "add":
                return [g, _sum_to(g_rows, updates)]
            if combine == "sub":
                return [g, _sum_to(-g_rows, updates)]
            if combine == "update":
                g_old = array_ops.tensor_scatter_nd_update(g, idx, array_ops.zeros_like(g_rows))
                return [g_old, _sum_to(g_rows, updates)]
            u = updates + array_ops.zeros_like(rows)  # broadcast a scalar update
            if combine == "mul":
                g_kept, g_u = g_rows * u, g_rows * rows
            elif combine == "div":
                g_kept, g_u = g_rows / u, -g_rows * rows / (u * u)
            else:
                # As tf.maximum / tf.minimum: a tie goes to the previous value.
                keep = rows >= u if combine == "max" else rows <= u
                keep = math_ops.cast(keep, g.dtype)
                g_kept, g_u = g_rows * keep, g_rows * (1 - keep)
            g_old = array_ops.tensor_scatter_nd_update(g, idx, g_kept)
            return [g_old, _sum_to(g_u, updates)]

        return Write([old, updates], backward, True, checks)

    return prepare


# -- slice writes --------------------------------------------------------------

_MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")


def _slice_assign(var: Any, old: Any, args: Dict[str, Any]) -> Write:
    begin, end, strides = args["begin"], args["end"], args["strides"]
    masks = {m: args.get(m, 0) for m in _MASKS}

    def backward(g: Any) -> List[Any]:
        g = _dense(g)
        g_value = array_ops.strided_slice(g, begin, end, strides, **masks)
        placed = gen_array_ops.strided_slice_grad(
            array_ops.shape(g, out_type=dtypes.as_dtype(ops.convert_to_tensor(begin).dtype)),
            begin, end, strides, g_value, **masks,
        )
        return [g - placed, g_value]

    return Write([old, args["value"]], backward, True, [])


# -- the registry ----------------------------------------------------------------

_V = ("value",)
_U = ("updates",)

RULES: Dict[str, OpRule] = {
    "AssignVariableOp": OpRule("resource", _V, _assign),
    "AssignAddVariableOp": OpRule("resource", _V, _assign_add),
    "AssignSubVariableOp": OpRule("resource", _V, _assign_sub),
    "ResourceStridedSliceAssign": OpRule("ref", _V, _slice_assign),
}
for _combine in ("update", "add", "sub", "mul", "div", "min", "max"):
    RULES["ResourceScatter" + _combine.capitalize()] = OpRule("resource", _U, _scatter(_combine, False))
for _combine in ("update", "add", "sub", "min", "max"):
    RULES["ResourceScatterNd" + _combine.capitalize()] = OpRule("ref", _U, _scatter(_combine, True))

# Inside a tf.cond branch, a write is replayed as the variable's whole new value,
# from plain ops, which the cond's symbolic gradient can differentiate: the
# functional rewrite itself. Writes without an entry are refused in branches.
def _scatter_value(combine: str, nd_form: bool) -> Callable[[Any, Dict[str, Any]], Any]:
    def value(old: Any, args: Dict[str, Any]) -> Any:
        indices = ops.convert_to_tensor(args["indices"])
        idx = indices if nd_form else array_ops.expand_dims(indices, -1)
        rows = array_ops.gather_nd(old, idx)
        u = args["updates"] + array_ops.zeros_like(rows)  # broadcast a scalar update
        if combine in ("mul", "div"):
            return array_ops.tensor_scatter_nd_update(old, idx, rows * u if combine == "mul" else rows / u)
        scatter = {
            "update": gen_array_ops.tensor_scatter_update,
            "add": gen_array_ops.tensor_scatter_add,
            "sub": gen_array_ops.tensor_scatter_sub,
            "min": gen_array_ops.tensor_scatter_min,
            "max": gen_array_ops.tensor_scatter_max,
        }[combine]
        return scatter(old, idx, u)

    return value


def _slice_value(old: Any, args: Dict[str, Any]) -> Any:
    masks = {m: args.get(m, 0) for m in _MASKS}
    return gen_array_ops.tensor_strided_slice_update(
        old, args["begin"], args["end"], args["strides"], args["value"], **masks
    )


BRANCH_VALUES: Dict[str, Callable[[Any, Dict[str, Any]], Any]] = {
    "AssignVariableOp": lambda old, args: args["value"],
    "AssignAddVariableOp": lambda old, args: old + args["value"],
    "AssignSubVariableOp": lambda old, args: old - args["value"],
    "ResourceStridedSliceAssign": _slice_value,
}
for _combine in ("update", "add", "sub", "mul", "div", "min", "max"):
    BRANCH_VALUES["ResourceScatter" + _combine.capitalize()] = _scatter_value(_combine, False)
for _combine in ("update", "add", "sub", "min", "max"):
    BRANCH_VALUES["ResourceScatterNd" + _combine.capitalize()] = _scatter_value(_combine, True)

# Ops that write variables and that the tape does not differentiate: the fused
# optimizer kernels of legacy Keras 2 (tf_keras) and tf.compat.v1 optimizers.
UNDIFFERENTIABLE_PREFIXES = ("ResourceApply", "ResourceSparseApply")
