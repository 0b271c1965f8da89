"""Serving handles: ``BaseResourceVariable._handle`` answers the current version.

``HandleDescriptor`` is installed over ``BaseResourceVariable._handle`` while any
tape is open (a scope exists, in any thread). Python (``self._handle``,
``self.handle``) and TensorFlow's C++ fast path (``PyObject_GetAttrString(var,
"_handle")``) both look the attribute up, so every read of every kind goes to
the current version. While none is, the class has no ``_handle``: reads cost
what they cost without assigntape, and ``constructed`` notes new handles.
The eager short paths (``_short_paths``) ask the same questions here
(``short_path_scope``), and a write op finds its variable here (``owner``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from assigntape import _signals
from assigntape._refusals import refuse_unnamed
from assigntape._registry import (
    _GRAPH_STACK,
    _all_scopes,
    _enclosing_scope,
    _tls,
    _with_unnamed,
    eager_scope,
    initializer_ops,
    served,
)
from assigntape._resolve import _RESOURCE_VARIABLE, resolve
from assigntape._resuming import _closed_records, _closed_refs, cut_on_first_read
from assigntape._tf import (
    BaseResourceVariable as _BASE_VARIABLE,
)
from assigntape._tf import (
    context as _context,
)
from assigntape._tf import (
    dtypes,
    gen_resource_variable_ops,
    ops,
    resource_variable_ops,
    tensor_lib,
)
from assigntape._versions import Scope, _by_handle, _eager_versions, canonical_handle, differentiable


def serves_own_handles() -> bool:
    """Whether ``v.handle`` is every variable's own handle here, and asking it
    has no side effect: no tape is open in this thread, or, eagerly, the only
    scope of the thread has no version, no write awaiting a first read, and
    no write through a handle no tape could name."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes:
        return True
    scope = eager_scope()
    return (
        scope is not None
        and len(scopes) == 1
        and not scope.current
        and not scope.dirty
        and not scope.unnamed
        and not getattr(_tls, "merging", ())
    )


def short_path_read_scope(var: Any) -> Optional[Scope]:
    """This thread's eager scope where a method of ``var`` may take its short
    path (``_short_paths``), else None: executing eagerly with no graph made
    the default (not inside ``tf.init_scope()`` while a function is traced,
    whose graph notes the variables used), on a plain ``ResourceVariable``
    (no distribution strategy's component)."""
    scope = eager_scope()
    if (
        scope is None
        or _GRAPH_STACK.stack
        or type(var) is not _RESOURCE_VARIABLE
        or var.__dict__.get("_distribute_strategy") is not None
    ):
        return None
    return scope


def short_path_scope(var: Any) -> Optional[Scope]:
    """``short_path_read_scope``, for a write method: also in a thread whose
    tape is the only one open in any thread (none could have seen the
    variable), not acting for a replica, on a differentiable variable."""
    scope = short_path_read_scope(var)
    if (
        scope is None
        or len(_tls.scopes) < len(_all_scopes)
        or getattr(_tls, "merging", None)
        or not differentiable(var)
    ):
        return None
    return scope


def owner(tensor: Any) -> Optional[Tuple[Scope, Any]]:
    """The scope and variable whose handle ``tensor`` is, if a tape tracks it
    (or, eagerly, if it is a variable's own handle: the tape tracks it from now)."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes or not isinstance(tensor, tensor_lib.Tensor) or getattr(_tls, "constructing", None):
        return None
    scope = _enclosing_scope(scopes)
    if scope is None:
        return None
    var = scope.owners.get(id(tensor))
    if var is None and isinstance(tensor, ops.EagerTensor):
        # (In a tape's graph too: the op is given the eager handle, captured after.)
        var = _by_handle.get(id(tensor))
        if var is None or var.__dict__.get("_handle") is not tensor:
            # A version an earlier tape made (``tape.versions(v)``, kept): it
            # names the same resource, so the variable's current version here.
            made = _eager_versions.get(id(tensor))
            if made is None or made[0]() is not tensor:
                return None
            return scope, made[1]
        # A handle fetched before the tape opened (or by code that keeps
        # handles): the variable's own, so the version the tape starts from.
        if var._unique_id not in scope.current:
            scope.owners[id(tensor)] = var
            scope.seen.add(var._unique_id)
            scope.canonical[id(tensor)] = var
        else:
            # Already written in this tape: the handle names its current version.
            scope.canonical[id(tensor)] = var
    return None if var is None else (scope, var)


def constructing(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """A variable's constructor (``UnliftedInitializerVariable``, which a
    ``tf.function`` makes on its first trace, Keras layers built lazily
    included): its initializing write, which TensorFlow puts in a ``tf.cond``
    in the function's graph, is creation, not a write a tape differentiates
    (as an eager variable's is not): left to TensorFlow."""
    _tls.constructing = getattr(_tls, "constructing", 0) + 1
    graph = ops.get_default_graph()
    before = len(graph.get_operations())
    try:
        return wrapped(*args, **kwargs)
    finally:
        _tls.constructing -= 1
        # The ops it made on its own handle (the initializing cond), which a
        # call of the function that runs them does not write through
        # (``_functions``: TensorFlow's first call of a function whose initial
        # values it could not lift out of the trace runs that cond). Not the
        # others: an initial value computed by writing another variable
        # writes that one.
        own = instance.__dict__.get("_handle")
        handles = {id(own)} | {id(i) for e, i in getattr(graph, "captures", ()) if e is own}
        made = {op.name for op in graph.get_operations()[before:] if any(id(t) in handles for t in op.inputs)}
        try:
            initializer_ops.setdefault(graph, set()).update(made)
        except TypeError:
            pass  # a graph that is not weakly referable: its writes stay counted


def accessed(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``tape.variable_accessed``, the first thing an eager read does: refuse
    a variable written through a handle no tape could name here, in Python,
    before TensorFlow's C++ code reads ``v.handle`` (an error raised from there
    would surface as a SystemError)."""
    scopes = getattr(_tls, "scopes", None) if _with_unnamed else None
    if scopes:
        scope = _enclosing_scope(scopes)
        if scope is not None and scope.unnamed:
            var = resolve(args[0] if args else kwargs.get("variable"))
            if var is not None and var._unique_id not in scope.current:
                refuse_unnamed(scope, var, var.__dict__.get("_handle"))
    return wrapped(*args, **kwargs)


def handle_for_read(handle: Any) -> Any:
    """The resource a raw read op (``tf.raw_ops.ReadVariableOp``, ...) given
    ``handle`` should read: the handle ``v.handle`` would give here now, if
    ``handle`` is one of the handles of a variable ``v`` a tape tracks (its
    own, fetched before the tape, or an earlier version): the read is then
    credited to the current version, as any other read."""
    found = owner(handle)
    if found is None:
        scopes = getattr(_tls, "scopes", None)
        scope = _enclosing_scope(scopes) if scopes else None
        if scope is not None and scope.unnamed:
            refuse_unnamed(scope, None, handle)
        return handle
    return found[1].handle


def note_handle(inst: Any, value: Any) -> None:
    """A variable's handle was set: noted, so that a write through a handle
    fetched before a tape opened can name its variable (``owner``)."""
    if type(inst) is _UNREAD_VARIABLE and not _all_scopes:
        # What ``assign`` returns, given its variable's own handle outside
        # every tape: the variable names it already.
        return
    if isinstance(value, ops.EagerTensor):
        known = _by_handle.get(id(value))
        # An ``_UnreadVariable`` (what ``assign`` returns) is given its
        # variable's handle: the variable stays its owner.
        if known is None or known.__dict__.get("_handle") is not value:
            _by_handle[id(value)] = inst


def constructed(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """``ResourceVariable.__init__`` and ``UninitializedVariable.__init__``,
    which set ``_handle``: noted while no descriptor is there to see it (a
    variable of another class, made outside every tape, is named only once
    a tape has read it)."""
    # Its initializing write, in a graph, is creation: not refused as a write
    # in a graph with no automatic control dependencies (``refuse_unordered_graph``).
    _tls.creating = getattr(_tls, "creating", 0) + 1
    try:
        wrapped(*args, **kwargs)
    finally:
        _tls.creating -= 1
    handle = instance.__dict__.get("_handle")
    if handle is not None:
        note_handle(instance, handle)
        # Its initialization went through the write patches (which could not
        # name it yet) as a write: for a closed tape it is creation, not a
        # write made while it was closed (its first read would be cut).
        for r in _closed_records() if _closed_refs else ():
            r.written_while_closed.pop(id(handle), None)


def _no_handle(inst: Any) -> AttributeError:
    """Python's own error for the missing attribute, as without the descriptor."""
    return AttributeError(f"{type(inst).__name__!r} object has no attribute '_handle'")


def serve_handle(scope: Scope, inst: Any, d: Dict[str, Any], handle: Any = None) -> Any:
    """The handle the descriptor serves for ``inst`` (whose ``__dict__`` is
    ``d``) in ``scope``, noted: ``handle`` if given (a cond branch's version),
    else the variable's current version there. (The short paths call it with
    the scope they found.)"""
    uid: Any = d.get("_unique_id")
    if handle is None:
        handle = scope.current.get(uid)
        if handle is None:
            handle = d.get("_handle")
            if handle is None:
                raise _no_handle(inst)
            if scope.dirty and id(handle) in scope.dirty:
                return cut_on_first_read(scope, inst, handle)
            if scope.unnamed:
                refuse_unnamed(scope, inst, handle)
    # Every handle served is noted, not only the first: a kept ``assign``
    # result serves an older version of the same variable, and the
    # other-thread check names writes by handle.
    scope.owners[id(handle)] = inst
    scope.seen.add(uid)
    return handle


class HandleDescriptor:
    """``BaseResourceVariable._handle`` while some scope is open: the current version.

    TensorFlow's C++ code looks the attribute up too (the eager fast path's
    ``ReadVariableOp``, the tapes' ``WatchVariable``), and does not expect
    it to fail: an exception raised here from there kills the process. So
    nothing here raises but Python's own error for a variable with no
    handle (as without the descriptor): any other error (a refused read, an
    interrupt) is deferred (``defer``), and the variable is served a handle
    that no read can use, so that the read fails in TensorFlow and the
    deferred error is raised at the next Python-level step.
    """

    def __get__(self, inst: Any, owner: Any = None) -> Any:
        # Every read asks this two or three times (TensorFlow fetches
        # ``v.handle`` that often, and once more for each tape watching).
        # (The try first: an asynchronous exception, PyThreadState_SetAsyncExc,
        # landing on a line before it would escape into TensorFlow's C++.)
        try:
            if inst is None:
                return self
            d = inst.__dict__
            scopes = getattr(_tls, "scopes", None)
            if scopes:
                ctx = _context._context
                if ctx is not None and ctx._thread_local_data.is_eager:
                    scope = scopes.get(None)
                    if scope is not None:
                        return serve_handle(scope, inst, d)
                else:
                    scope = _enclosing_scope(scopes)
                    if scope is not None:
                        branches = getattr(_tls, "branches", None)
                        branch = branches.get(ops.get_default_graph()) if branches else None
                        # Inside a cond branch that wrote the variable: its branch version.
                        return serve_handle(
                            scope, inst, d, None if branch is None else branch.version_of_uid(d.get("_unique_id"))
                        )
            return d["_handle"]
        except BaseException as error:  # noqa: B036 - an interrupt too: see the class docstring
            if inst is None:
                return self
            if "_handle" not in inst.__dict__:
                raise _no_handle(inst) from None
            return defer(error)

    def __set__(self, inst: Any, value: Any) -> None:
        if type(inst) is _UNREAD_VARIABLE and isinstance(value, ops.EagerTensor):
            # What ``assign`` returns inside a tape is given the version being
            # read: it keeps its variable's own handle instead, as in plain
            # TensorFlow, and is served the current version through this
            # descriptor while a tape is open (it shares the unique id). Kept
            # after the tape, it would otherwise credit the old version.
            made = _eager_versions.get(id(value))
            if made is not None and made[0]() is value:
                value = canonical_handle(made[1])
        inst.__dict__["_handle"] = value
        note_handle(inst, value)

    def __delete__(self, inst: Any) -> None:
        del inst.__dict__["_handle"]


# The shared name of the resource behind the handle ``defer`` serves: a
# resource never created, so that any read through it fails in TensorFlow
# (with this name in the message, where the deferred error was not raised).
POISON_NAME = "assigntape_refused_read_see_the_UntrackedWriteError_raised_before"


def defer(error: BaseException) -> Any:
    """Keeps ``error``, raised where TensorFlow's C++ code may be the caller,
    for this thread's next Python-level step (``raise_deferred``), and returns
    the handle to serve meanwhile: one no read can use, so that the read
    fails in TensorFlow, cleanly, and its error is replaced by ``error``
    (``not_ok_status``). A first error deferred is kept over later ones."""
    if getattr(_tls, "deferred", None) is None:
        _tls.unpoisoned = False
        _tls.deferred = error
    try:
        with ops.init_scope():
            return gen_resource_variable_ops.var_handle_op(
                dtype=dtypes.float32, shape=[], shared_name=POISON_NAME, container=""
            )
    except BaseException:  # noqa: B036 - no handle to serve: the variable's own, the error still deferred
        # (A failed op then does not name the handle: the next one raises it.)
        _tls.unpoisoned = True
        return _no_poison


def _no_poison() -> None:
    """What ``defer`` returns if it cannot make a handle: nothing a read can
    use either (C++'s read refuses anything but a tensor)."""


def take_deferred() -> Optional[BaseException]:
    """The error ``defer`` kept in this thread, if any, forgotten here."""
    error = getattr(_tls, "deferred", None)
    if error is not None:
        _tls.deferred = None
    return error


def raise_deferred() -> None:
    """Raises the error ``defer`` kept in this thread, if any."""
    error = take_deferred()
    if error is not None:
        raise error


def not_ok_status(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``ops.raise_from_not_ok_status``, which every generated op wrapper
    calls, in Python, when its op failed in C++: where a read through the
    handle ``defer`` served has failed (TensorFlow's error names it), the
    error deferred is the one to raise. An op that failed for a reason of
    its own (the user's, which their handler may be waiting for) raises its
    own error; the deferred one waits for the next read through that handle,
    or the tape's exit."""
    failed = args[0] if args else kwargs.get("e")
    if getattr(_tls, "deferred", None) is not None and (_tls.unpoisoned or POISON_NAME in str(failed)):
        error = take_deferred()
        if error is not None:
            raise error.with_traceback(None) from None
    return wrapped(*args, **kwargs)


_READING = HandleDescriptor()
_signals.called_from_c(HandleDescriptor.__get__.__code__)  # no signal handler raises in it
served.append((_BASE_VARIABLE, "_handle", _READING, None))


def _of_own_handle(name: str, original: Any) -> property:
    """``BaseResourceVariable.<name>`` (``op``, ``graph``, ``device``), which
    TensorFlow derives from ``v.handle``, taken from the variable's own handle
    while versions are served: a variable is the same variable after a write.
    Through a version, a variable written in a ``tf.function`` would have an
    ``op`` (the version's identity) where TensorFlow raises AttributeError
    (an eager handle has none), and slot lookups keyed by it
    (``tf.compat.v1.train``'s ``_var_key``) would not find the slots made
    for the variable."""

    def get(self: Any) -> Any:
        own = self.__dict__.get("_handle")
        if own is None:  # a wrapper with no handle of its own: TensorFlow's way
            return original.fget(self)
        return getattr(own, name)

    return property(get, original.fset, original.fdel, original.__doc__)


for _name in ("op", "graph", "device"):
    _original = _BASE_VARIABLE.__dict__[_name]
    served.append((_BASE_VARIABLE, _name, _of_own_handle(_name, _original), _original))
_UNREAD_VARIABLE = resource_variable_ops._UnreadVariable
