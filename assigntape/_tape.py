"""``AssignAwareTape``: a ``tf.GradientTape`` through which gradients cross writes."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import tensorflow as tf

from assigntape import (
    _control_gradients,
    _datasets,
    _diagnostics,
    _forks,
    _graph_gradients,
    _patches,
    _plain_gradients,
    _plain_tapes,
    _py_functions,
    _record,
    _registry,
    _resolve,
    _resuming,
    _serving,
    _versions,
)
from assigntape._errors import NotAVariableError
from assigntape._tf import (
    UnconnectedGradients,
    array_ops,
    dtypes,
    gen_resource_variable_ops,
    nest,
    resource_variable_ops,
    tensor_lib,
)

# The class of (nearly) every variable: a source of that exact type is asked
# nothing more (not ``isinstance``: subclasses may wrap another variable).
_RESOURCE_VARIABLE = resource_variable_ops.ResourceVariable

__all__ = ["AssignAwareTape"]


_as_tf_variable = _resolve.resolve


class AssignAwareTape(tf.GradientTape):
    """A ``tf.GradientTape`` that differentiates through variable writes.

    While the tape is open, every write to a floating-point ``tf.Variable``
    (``assign``, ``assign_add``, ``assign_sub``, scatter and slice writes, and so
    every Keras 3 variable write and optimizer step) makes a new *version* of the
    variable. Later reads, by any
    path, see that version, and gradients flow through the write into whatever
    produced the written value. The result is the gradient of the program in which
    every write rebinds a fresh tensor.

    In ``gradient``, a variable given as a source means its value when the tape
    started, and a variable given as a target means its latest version. Use
    ``versions(var)`` to name any version in between. With no writes, every
    result is exactly that of ``tf.GradientTape``.

    Args:
      persistent: As for ``tf.GradientTape``: allow more than one ``gradient``.
      watch_accessed_variables: As for ``tf.GradientTape``: watch trainable
        variables when they are read.
      untracked_writes: What to do when a variable the tape tracks is written
        where the tape cannot differentiate the write (a ``tf.function``
        called from an eager tape, an op without a gradient rule):
        ``"raise"`` (the default) raises ``UntrackedWriteError``; ``"cut"``
        warns and makes the write a new version with no gradient path.

    Example:

    >>> a, b, c = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0)
    >>> with AssignAwareTape() as tape:
    ...     _ = c.assign(a + b)
    ...     loss = c ** 2
    >>> float(tape.gradient(loss, b))
    6.0
    """

    # False for an internal tape that only makes versions for forward mode
    # (``_forward``): nothing asks it for gradients, so it keeps no history.
    _keeps_history = True
    # How the modules below tell it from a plain tape without importing it.
    _assigntape_aware = True

    def __init__(
        self,
        persistent: bool = False,
        watch_accessed_variables: bool = True,
        untracked_writes: str = "raise",
    ) -> None:
        if untracked_writes not in ("raise", "cut"):
            raise ValueError(f"untracked_writes must be 'raise' or 'cut', got {untracked_writes!r}")
        super().__init__(persistent=persistent, watch_accessed_variables=watch_accessed_variables)
        self._untracked_writes = untracked_writes
        self._scope: Optional[_versions.Scope] = None
        # Versions current when the tape was entered (written by an outer tape).
        # Its own account of the versions it saw (``_record``): the scopes
        # append to it, and gradient, versions, explain and history read it.
        self._record = _record.Record(self, untracked_writes, self._keeps_history)
        # Whether the tape was entered (since construction or reset()).
        self._entered = False

    # -- context ---------------------------------------------------------------

    def __enter__(self) -> "AssignAwareTape":
        if self._recording:
            super().__enter__()  # TensorFlow's error: the tape is open already
        _forks.refuse_forgotten(self._record, self)  # (before anything changes)
        # Entering is all or nothing: an exception at any point of it (a
        # KeyboardInterrupt from a signal handler) puts back what it changed.
        record, tape, entered, key = self._record, self._tape, self._entered, _registry.current_key()
        closed = record in _resuming.closed_tapes
        # What entering again changes (first entries change only the scope's
        # records and the record's start, which a tape not entered has empty).
        before = (
            (_versions.scope_state(key, True), record.state()) if entered else (_versions.scope_state(key, False), None)
        )
        try:
            self._enter(record)
            return self
        except BaseException:
            self._undo_enter(record, tape, entered, key, closed, before)
            raise

    def _undo_enter(
        self, record: _record.Record, tape: Any, entered: bool, key: Any, closed: bool, before: Any
    ) -> None:
        """Puts back what an interrupted ``__enter__`` changed (each step
        whether or not it was reached)."""
        self._scope = None
        _versions.abandon_scope(key, record, before[0])
        if before[1] is not None:
            record.put_back(before[1])
        elif not entered:
            record.restart({}, {})
        self._entered = entered
        if closed:
            self._start_lease()
        _patches.release(record)
        if self._recording:
            self._pop_tape()
        self._tape = tape

    def _enter(self, record: _record.Record) -> None:
        _patches.refuse_unfollowed_recorders()
        super().__enter__()  # raises, with nothing acquired, if already recording
        _patches.acquire(record)
        self._end_lease()
        scope = self._scope = _versions.open_scope(record)
        if _datasets._ahead:
            _datasets.note_ahead(scope)  # iterators running a writing dataset ahead
        if not self._entered:
            self._entered = True
            self._snapshot_start(scope)
            return
        # Entered again: it goes on from the latest versions it knows (the
        # one path of every kind of recorder: ``_resuming.enter_again``).
        latest = record.latest()
        known = {uid: (mine, record.owner_of(uid, mine)) for uid, mine in latest.items()}
        _resuming.enter_again(scope, record, known, record.written_while_closed, super().watched_variables())
        record.written_while_closed.clear()

    def __exit__(self, typ: Any, value: Any, traceback: Any) -> None:
        # Exiting always finishes: an exception at any point of it (a
        # KeyboardInterrupt from a signal handler) has every step run once
        # more (each can be), then goes on. (One line: the ``try`` line's own
        # line event is then inside it.)
        try: self._exit(typ, value, traceback)  # noqa: E701  # fmt: skip
        except BaseException:
            scope = self._scope
            if scope is not None:
                self._close(scope)
            raise
        # An error the handle descriptor deferred (a read TensorFlow's C++
        # code made, refused) that no later step raised: raised on the way out
        # unless another is.
        deferred = _serving.take_deferred()
        if deferred is not None and typ is None:
            raise deferred

    def _exit(self, typ: Any, value: Any, traceback: Any) -> None:
        try:
            super().__exit__(typ, value, traceback)
        finally:
            scope = self._scope
            if scope is not None:
                self._close(scope)

    def _close(self, scope: _versions.Scope) -> None:
        """The tape's exit after TensorFlow's; ``self._scope`` stays set
        until the last step, so that an interrupted exit can finish."""
        if self._recording:
            self._pop_tape()  # (TensorFlow's __exit__, if it was interrupted before it)
        record = self._record
        if any(r is record for r in scope.records):
            # The versions it did not see made, of the variables it knew and
            # did not read again, are its latest (``_resuming.settle``).
            _resuming.settle(scope, record)
            # Writes made while this tape was closed before and not read
            # since it was entered again stay writes with no gradient path
            # for it when it is entered once more (the scope forgets its
            # note of them when its last tape closes).
            _resuming.note_closed_writes(scope, record)
            _graph_gradients.note_closed(scope, record)
            holders = _plain_tapes.note_closing()
            _versions.close_scope(scope, record, holders)
        else:
            _versions.finish_close(scope, record)
        if self._tape is not None:
            self._start_lease()
        _patches.release(record)
        self._scope = None

    def _start_lease(self) -> None:
        """Keeps the patches installed while the tape is closed, and has every
        write made meanwhile noted, for when it is entered again (until
        ``_end_lease``, or until the tape is garbage: the set is weak)."""
        _registry.hold_closed(self._record)

    def _end_lease(self) -> None:
        _resuming.closed_tapes.discard(self._record)

    def reset(self) -> None:
        """Clears the tape, as ``tf.GradientTape.reset``; versions start again here."""
        # Entered again: the versions it did not see made, not read yet, are
        # where it starts anew (as a tape entered here would start from them).
        self._settle()
        super().reset()
        self._end_lease()
        _resuming.forget_closed_writes(self._record)
        self._entered = self._scope is not None
        scope = self._scope
        self._record.restart(
            {} if scope is None else _resuming.versions_for(scope, self._record), {} if scope is None else scope.owners
        )

    def _snapshot_start(self, scope: _versions.Scope) -> None:
        """The versions current now (written by another tape) start this tape."""
        self._record.restart(scope.current, scope.owners)

    def watch(self, tensor: Any) -> None:
        """As ``tf.GradientTape.watch``; a wrapped variable (Keras 3, mixed
        precision, distributed) watches the variable it stands for."""

        def inner(t: Any) -> Any:
            var = _resolve.resolve(t)
            return t if var is None else var

        super().watch(nest.map_structure(inner, tensor))

    def watched_variables(self) -> Tuple[Any, ...]:
        """The variables the tape watches, as ``tf.GradientTape.watched_variables``:
        each once, however many versions of it were read, in TensorFlow's order."""
        return _resolve.watched_in_order(super().watched_variables())

    def _watched(self, var: Any) -> bool:
        return any(_as_tf_variable(w) is var for w in self.watched_variables())

    @contextlib.contextmanager
    def restoring(self, variables: Any) -> Iterator[None]:
        """Writes ``variables`` back, on exit, to the values they had on entry.

        Use it between the tasks of a meta-batch: each task adapts the model's
        weights in its inner loop, then the next task starts again from the
        values the weights had when the block began. The write back is itself a
        tracked write of the saved value, so gradients of later tasks' losses
        still reach the weights' start-of-tape versions.

        Args:
          variables: a nested structure of ``tf.Variable`` or Keras 3 variables,
            such as ``model.trainable_variables``.

        Raises:
          NotAVariableError: an element of ``variables`` is not a variable.

        Example:

        >>> w = tf.Variable(2.0)
        >>> with AssignAwareTape() as tape:
        ...     losses = []
        ...     for x in (1.0, 3.0):
        ...         with tape.restoring([w]):
        ...             _ = w.assign_sub(0.1 * w * x)  # the inner step of one task
        ...             losses.append(w * x)
        ...     loss = losses[0] + losses[1]
        >>> float(w)                                   # both tasks started from 2.0
        2.0
        >>> round(float(tape.gradient(loss, w)), 4)    # 0.9 * 1 + 0.7 * 3
        3.0
        """
        tf_vars = [self._require_variable(v, "restoring") for v in nest.flatten(variables)]
        # Read through the current version, on this tape, so the saved value
        # carries the gradient back to it.
        saved = [v.read_value() for v in tf_vars]
        try:
            yield
        finally:
            for var, value in zip(tf_vars, saved):
                var.assign(value)

    # -- versions --------------------------------------------------------------

    def versions(self, variable: Any) -> Tuple[tf.Tensor, ...]:
        """The versions of ``variable`` in this tape, oldest first.

        Index 0 is the variable at the start of the tape and -1 its latest
        version. Each version is a resource handle tensor: pass it to
        ``gradient`` as a source or a target. Reading a handle reads the
        variable's present value, whichever version it names.

        Args:
          variable: a ``tf.Variable`` or a Keras 3 variable.

        Returns:
          A tuple with one handle for the start and one more for each write.

        Raises:
          NotAVariableError: ``variable`` is not a variable.
        """
        return self._versions_of(self._require_variable(variable, "versions"))

    @staticmethod
    def _require_variable(variable: Any, method: str) -> Any:
        var = _resolve.gradient_variable(variable)
        if var is None:
            raise NotAVariableError(
                f"{method}() takes a tf.Variable or a Keras variable, got "
                f"{type(variable).__name__}. Tensors have no versions: pass the "
                f"tensor itself to gradient()."
            )
        return var

    def _versions_of(self, var: Any) -> Tuple[Any, ...]:
        self._settle()
        return self._record.versions_of(var, _versions.canonical_handle(var))

    def _settle(self) -> None:
        """Entered again, it names the versions it did not see made before
        the variables' first read (``_resuming.settle``)."""
        scope = self._scope
        if scope is not None and scope.dirty:
            _resuming.settle(scope, self._record)

    def _latest(self, x: Any) -> Any:
        """What a target ``x`` means: its latest version if it is a variable
        (one this tape did not see made if the variable was written while it
        was closed and not read since: no gradient path), else ``x`` itself."""
        var = _resolve.gradient_variable(x)
        if var is None:
            return x
        known = self._versions_of(var)[-1]
        scope = self._scope
        if scope is None:  # closed: as at its last exit
            own = _versions.canonical_handle(var)
            return _versions.new_version(own, None) if id(own) in self._record.unseen_at_exit else known
        if var._unique_id in scope.current:
            return known
        return _resuming.latest_version(scope, var, self._record, known)

    # -- gradients -------------------------------------------------------------

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = UnconnectedGradients.NONE,
    ) -> Any:
        """Computes gradients as ``tf.GradientTape.gradient``, across writes.

        A variable among ``sources`` stands for its value at the start of the
        tape, a variable among ``target`` for its latest version; a handle from
        ``versions()`` stands for that version.

        Args:
          target: a nested structure of tensors, variables or versions.
          sources: a nested structure of tensors, variables or versions.
          output_gradients: as for ``tf.GradientTape.gradient``.
          unconnected_gradients: ``'none'`` or ``'zero'``, as for
            ``tf.GradientTape.gradient``. With ``'zero'``, a variable or version
            source gets zeros of the variable's shape and dtype.

        Returns:
          Gradients in the structure of ``sources``.
        """
        _serving.raise_deferred()
        if target is None:
            return super().gradient(target, sources, output_gradients, unconnected_gradients)
        record = self._record
        finish = None
        if (
            not record.suspects
            and record.versions_start_own()
            and _resolve.plain_question(target, sources, unconnected_gradients)
            and _serving.serves_own_handles()
        ):
            # Every variable's first version here is its own handle, the
            # sources are plain variables, the target a tensor, and
            # ``v.handle`` (which TensorFlow takes) is the variable's own:
            # TensorFlow's answer is the tape's, asked with nothing mapped.
            given: Any = sources
        else:
            target, given, unconnected_gradients, finish = self._mapped_question(target, sources, unconnected_gradients)
        # TensorFlow's gradient (or a mixin's, next in the MRO) is called from
        # this very frame, past the plain tapes' follower
        # (``_plain_gradients.tensorflows_gradient``): every frame between the
        # caller and TensorFlow costs each op of the backward pass.
        # A non-persistent tape is done once asked: writes need no following
        # from here, and while a closed tape is followed every patched
        # function does its work, in the backward pass too.
        done = not self._persistent
        _control_gradients.refuse_lacking(target, "gradient")
        if done:
            self._end_lease()
        _control_gradients.differentiating(1)
        try:
            grads = _plain_gradients.tensorflows_gradient(type(self), AssignAwareTape)(
                self, target, given, output_gradients, unconnected_gradients
            )
        except BaseException:
            if done and self._tape is not None and self._scope is None:
                self._start_lease()  # closed, and TensorFlow kept the record: it may be asked again
            raise
        finally:
            _control_gradients.differentiating(-1)
        return grads if finish is None else finish(grads)

    def _mapped_question(
        self, target: Any, sources: Any, unconnected_gradients: Any
    ) -> Tuple[Any, List[Any], Any, Any]:
        """``gradient``'s question as TensorFlow must be asked it: the target
        mapped to versions, the sources given as versions (or variables where
        that is the same), ``unconnected_gradients`` for TensorFlow, and the
        function that makes TensorFlow's answer the tape's."""
        record = self._record
        if record.suspects:
            _control_gradients.complete_record(record)
        # A flat list or tuple (of variables and tensors, the usual sources)
        # needs none of nest's flattening and packing, which cost as much as
        # the rest here; a plain variable is never nested, asked without nest.
        simple = type(sources) in (list, tuple)
        if simple:
            for s in sources:
                if type(s) is not _RESOURCE_VARIABLE and nest.is_nested(s):
                    simple = False
                    break
        flat_sources = list(sources) if simple else nest.flatten(sources)
        mapped_sources: List[Any] = []
        # What TensorFlow is given: the variable itself where ``v.handle`` is
        # the version wanted and serving it has no side effect (no tape open in
        # this thread: the variable's own handle), as it takes ``v.handle``
        # itself and a bare handle costs it two failed attribute lookups more
        # a source; else the version.
        plain = not _registry.open_here()
        given: List[Any] = []
        # (``Record.first_version``, inlined: every source asks it.)
        versions, start = record.versions, record.start
        for s in flat_sources:
            if type(s) is _RESOURCE_VARIABLE and "_handle" in s.__dict__:
                var = s  # the usual case, without resolve()'s questions
            else:
                var = _resolve.gradient_variable(s)
                if var is None:
                    mapped_sources.append(s)
                    given.append(s)
                    continue
            own = var.__dict__["_handle"]  # _versions.canonical_handle(var)
            uid = var._unique_id
            written = versions.get(uid)
            version = start.get(uid, own) if written is None else written[0]
            mapped_sources.append(version)
            given.append(var if plain and version is own else version)
        if isinstance(target, tensor_lib.Tensor):  # the common case, without nest
            mapped_target = target
        else:
            mapped_target = nest.map_structure(self._latest, target)
        zero = unconnected_gradients in (UnconnectedGradients.ZERO, "zero")

        def finish(flat_grads: List[Any]) -> Any:
            if zero:
                flat_grads = [
                    self._zeros_for(raw, mapped) if g is None else g
                    for g, raw, mapped in zip(flat_grads, flat_sources, mapped_sources)
                ]
            if simple:
                return type(sources)(flat_grads)
            return nest.pack_sequence_as(sources, flat_grads)

        return mapped_target, given, UnconnectedGradients.NONE if zero else unconnected_gradients, finish

    def jacobian(self, target: Any, sources: Any, *args: Any, **kwargs: Any) -> Any:
        """As ``tf.GradientTape.jacobian``; a variable target means its latest version."""
        return super().jacobian(self._target_value(target), sources, *args, **kwargs)

    def batch_jacobian(self, target: Any, source: Any, *args: Any, **kwargs: Any) -> Any:
        """As ``tf.GradientTape.batch_jacobian``; a variable target means its latest
        version, a variable source its value at the start of the tape."""
        return super().batch_jacobian(self._target_value(target), source, *args, **kwargs)

    def _target_value(self, target: Any) -> Any:
        """A variable target's latest version, or a version of ``versions()``,
        read on this tape: TensorFlow's jacobians reshape and gather the
        target, which would read the variable's own handle (or, for a version,
        gather a resource handle, which has no gradient)."""
        var = _as_tf_variable(target)
        if var is not None:
            handle = self._latest(var)
        else:
            var = self._record.owners.get(id(target))
            if var is None or getattr(target, "dtype", None) != dtypes.resource:
                return target
            handle = target
        with self._ensure_recording():
            return gen_resource_variable_ops.read_variable_op(handle, var.dtype)

    # -- diagnostics -----------------------------------------------------------

    def explain(self, target: Any, sources: Any) -> _diagnostics.Explanation:
        """Computes the gradients, and says why any of them is None or zero.

        For each source without a gradient, the report names the variable (or
        the tensor's place in ``sources``) and gives one reason, with a code in
        ``Reason``: overwritten before any read that reaches the target; never
        touched on the tape; only non-differentiable ops or dtypes on the way;
        the breaking write ran under ``stop_recording``; the breaking write was
        cut (``untracked_writes="cut"``); a recorded value left TensorFlow
        (``.numpy()``) at a named line; a tensor that was not watched; or an
        all-zero gradient (eager only: inside ``tf.function`` the values are
        not known yet, so only missing gradients are explained).

        It costs one ``gradient`` call, with every version of each variable
        source as an extra source. On a non-persistent tape, call it instead of
        ``gradient``: the report holds the gradients.

        Args:
          target: as for ``gradient``.
          sources: as for ``gradient``.

        Returns:
          An ``Explanation``: ``str()`` it to read; ``.gradients`` has the
          gradients in the structure of ``sources``; ``.reports`` one
          ``SourceReport`` (name, status, reason, message) per flattened source.

        Example:

        >>> a, c = tf.Variable(1.0), tf.Variable(0.0)
        >>> with AssignAwareTape() as tape:
        ...     _ = a.assign(5.0)                # a's start value is lost here
        ...     loss = a * 2.0 + c
        >>> report = tape.explain(loss, {"a": a, "c": c})
        >>> report.reports[0].reason, report.reports[1].status
        ('overwritten_before_read', 'ok')
        """
        self._settle()
        return _diagnostics.explain(self, self._record, target, sources, _as_tf_variable)

    def history(self) -> _diagnostics.History:
        """The versions of every variable written on this tape, and their ops.

        Returns:
          A ``History``: ``str()`` lists, per variable, each version and the op
          that made it (and whether the write was cut or ran under
          ``stop_recording``); ``to_dot()`` gives the same as Graphviz DOT;
          ``.variables`` maps names to ``VersionRecord`` lists, whose
          ``handle`` is the version to pass to ``gradient``.

        Example:

        >>> w = tf.Variable([1.0, 2.0], name="w")
        >>> with AssignAwareTape() as tape:
        ...     _ = w.assign_add([1.0, 1.0])
        ...     _ = w[0].assign(0.0)
        >>> print(tape.history())
        w:0: 3 versions
          v0: start of tape
          v1: AssignAddVariableOp
          v2: ResourceStridedSliceAssign
        """
        self._settle()
        return _diagnostics.history(self._record)

    def _zeros_for(self, raw: Any, mapped: Any) -> Any:
        # TensorFlow cannot build zeros for a raw resource handle (it has no
        # float shape or dtype). Where the variable's shape is not fully
        # defined, a version's shape is the one recorded at the write after it.
        var = _as_tf_variable(raw)
        if var is None:
            var = self._record.owners.get(id(mapped))
        if var is None:
            return array_ops.zeros_like(mapped)
        shape = None
        uid = var._unique_id
        for handle, write in zip(self._record.versions.get(uid, ()), self._record.writes.get(uid, [])):
            if handle is mapped:
                shape = write.old_shape
        return _resolve.zeros_like_source(var, mapped, shape)


# A py_function body traced under a tape runs under a probing tape of this class.
_py_functions.probe_tape = AssignAwareTape
