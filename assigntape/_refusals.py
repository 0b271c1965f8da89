"""Writes no tape can differentiate: refused, or cut (a new version with no gradient path).

``refuse_or_cut`` is the one answer to such a write; the others find the
writes it applies to: a write through a handle no tape could name
(``unknown_variable_write``, refused at its first read), and a write in a
graph with no automatic control dependencies (``refuse_unordered_graph``).
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence

from assigntape._errors import GraphWriteOrderError, UntrackedWriteError
from assigntape._record import WriteRecord
from assigntape._registry import _all_lock, _check_reads, _enclosing_scope, _tls, _with_unnamed
from assigntape._resuming import first_touch
from assigntape._tf import (
    dtypes,
    executing_eagerly,
    gen_resource_variable_ops,
    ops,
    pywrap_tfe,
    resource_variable_ops,
)
from assigntape._versions import Scope, new_version, variable_of_handle


def refuse_or_cut(scopes: List[Scope], var: Any, what: str, message: str) -> None:
    """The one answer to a write of ``var`` that the tapes of ``scopes`` cannot
    differentiate: raise ``UntrackedWriteError`` with ``message`` unless every
    tape there passed ``untracked_writes="cut"``, in which case warn. Call it
    before the write, so that a refusal leaves the variable and the tapes as
    they were, and ``cut`` after it."""
    if any(scope.refuses_untracked() for scope in scopes):
        raise UntrackedWriteError(
            message + " Or pass AssignAwareTape(untracked_writes='cut') to treat the write as a "
            "new version with no gradient path."
        )
    warnings.warn(
        f"AssignAwareTape: {what} wrote {var.name!r}; no gradient flows through that write (untracked_writes='cut').",
        stacklevel=4,
    )


def cut(scopes: List[Scope], var: Any, what: str, after: Any = None) -> None:
    """After a write ``refuse_or_cut`` let through: a new version, no gradient path."""
    for scope in scopes:
        old = first_touch(scope, var)
        scope.advance(var, old, new_version(old, after), WriteRecord(what, cut=True))


def unknown_variable_write(tensor: Any, op_name: str) -> None:
    """Notes, inside a recording tape, a write through an eager handle no tape
    can name (a variable created before any tape, its handle fetched before
    this one opened) to an initialized floating-point variable. Its first read
    in the tape is refused (``refuse_unnamed``): the tape would read the
    written value and credit the version from before. A variable the tape
    never reads is plain TensorFlow; a variable's first write (its
    initialization) is not noted."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes or not isinstance(tensor, ops.EagerTensor):
        return
    scope = _enclosing_scope(scopes)
    if scope is None or tensor.dtype != dtypes.resource or pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return
    data = resource_variable_ops.get_eager_safe_handle_data(tensor)
    if not data.is_set or not data.shape_and_type:
        return
    dtype = dtypes.as_dtype(data.shape_and_type[0].dtype)
    if not (dtype.is_floating or dtype.is_complex):
        return
    with ops.init_scope():  # the handle is eager, even while a graph is built
        if not gen_resource_variable_ops.var_is_initialized_op(tensor):
            return
    note_unseen_writer(scope, tensor, op_name, "")


def note_unseen_writer(scope: Scope, handle: Any, op_name: str, refusal: str) -> None:
    """Refuses the first read in ``scope`` of the variable whose own handle is
    ``handle``: written (or, by TensorFlow's runtime, maybe written) out of
    the tapes' sight, by ``op_name``; ``refusal`` says so, if given."""
    scope.unnamed[id(handle)] = (handle, op_name, refusal)
    with _all_lock: _list_unnamed_locked(scope)  # noqa: E701 - see _registry._list  # fmt: skip


def _list_unnamed_locked(scope: Scope) -> None:
    if not _with_unnamed:
        _check_reads(True)
    _with_unnamed.add(id(scope))


def refuse_unnamed(scope: Scope, var: Any, handle: Any) -> None:
    """Raises if ``var`` (its own ``handle``) was written through a handle no
    tape could name since ``scope``'s tape opened (``unknown_variable_write``)."""
    found = scope.unnamed.get(id(handle))
    if found is None or found[0] is not handle:
        return
    if found[2]:
        raise UntrackedWriteError(found[2])
    raise UntrackedWriteError(
        f"{'A variable' if var is None else f'Variable {var.name!r}'} was written by {found[1]} through a resource handle that no "
        "open AssignAwareTape could name (the variable was created before assigntape's "
        "first tape, and the handle fetched before this tape opened), and is now read in "
        "the tape: it would read the written value and credit the version from before, a "
        "silently wrong gradient. Fetch the handle inside the tape (v.handle), or write "
        "with v.assign / assign_add / assign_sub."
    )


def refuse_unordered_graph(handles: Sequence[Any], op_name: str) -> None:
    """Refuses a write to a floating-point variable built, while a tape is open
    in this thread (an AssignAwareTape, or versions held for a followed plain
    recorder), in a graph with no automatic control dependencies: a TF1 graph
    (its cond and loop bodies, TF1 control flow included) or a
    ``tf.compat.v1.wrap_function``. There ops run in no build order and a
    write nothing depends on is pruned, while versions assume build order is
    run order (which a ``tf.function``'s automatic control dependencies give,
    in its cond and loop bodies too): a gradient, even a value, could be
    silently wrong. Raised before anything is written or noted. A write while
    a variable is created (its initializer) is creation, not refused."""
    creating: int = getattr(_tls, "creating", 0)
    if creating or not getattr(_tls, "scopes", None) or executing_eagerly():
        return
    graph: Any = ops.get_default_graph()
    while graph is not None:
        # A graph staged inside a function being traced (AutoGraph traces a
        # loop body once in a throwaway FuncGraph, with no automatic control
        # dependencies, whose ops never run) is that function's business.
        if getattr(graph, "_add_control_dependencies", False):
            return
        graph = getattr(graph, "outer_graph", None)
    for handle in handles:
        dtype = _resource_dtype(handle)
        if dtype is not None and not (dtype.is_floating or dtype.is_complex):
            continue  # not differentiable: plain TensorFlow, as everywhere
        raise GraphWriteOrderError(
            f"{op_name} to variable {_resource_name(handle)!r} in a TF1 graph / wrap_function while an "
            "AssignAwareTape is open in this thread: a TF1 graph / wrap_function has no automatic "
            "control dependencies, so the order of writes is not known when the graph is built "
            "(TensorFlow may run them in any order, or prune a write nothing depends on), and the "
            "tape's versions could be silently wrong. Build the program in a tf.function (with the "
            "tape inside it, or around its call), or make the write outside every tape."
        )


def _resource_dtype(handle: Any) -> Any:
    """The dtype of the variable a resource handle names, or None if unknown."""
    var = _scope_owner(handle)
    if var is not None:
        return var.dtype
    try:
        data = resource_variable_ops.get_eager_safe_handle_data(handle)
    except (TypeError, ValueError, AttributeError):
        return None
    if not data.is_set or not data.shape_and_type:
        return None
    return dtypes.as_dtype(data.shape_and_type[0].dtype)


def _resource_name(handle: Any) -> str:
    """A name for the variable behind a resource handle, for a message."""
    var = _scope_owner(handle)
    if var is not None:
        return str(var.name)
    op = getattr(handle, "op", None)
    if op is not None and op.type == "VarHandleOp":
        name: str = op.get_attr("shared_name").decode() or op.name
        return name
    return str(getattr(op, "name", "a variable"))


def _scope_owner(handle: Any) -> Optional[Any]:
    """The variable a handle names: its own (eager) handle, or a version or
    handle served by a scope of this thread."""
    var = variable_of_handle(handle)
    if var is not None:
        return var
    for scope in getattr(_tls, "scopes", {}).values():
        var = scope.owners.get(id(handle))
        if var is not None:
            return var
    return None
