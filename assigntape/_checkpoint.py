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

That op's backward function (``_segment_op``) runs the step again from the
checkpoint and differentiates it; what the first run notes and refuses is in
``_segment_checks``; ``unroll`` (``_unroll``) calls ``run_segment`` once per
segment. So the tape keeps, per segment, the checkpoint and the versions at
its boundary, and nothing from inside it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from assigntape import _registry, _resuming, _versions, _writes
from assigntape._errors import RecomputeError
from assigntape._record import CLOSED_WRITE, WriteRecord
from assigntape._segment_checks import (
    Refusals,
    TouchLog,
    assign,
    float_tensor,
    is_float,
    leave,
    remove_callback,
    resume,
)
from assigntape._segment_op import Segment, fingerprints
from assigntape._tf import forwardprop, nest, op_callbacks, ops, pywrap_tfe, record

__all__ = ["checkpointed"]

_WRITE = "Checkpointed"


def _body_kind(graph: Any) -> str:
    kind = type(graph).__name__
    return "tf.cond branch" if "Cond" in kind else "loop body" if "While" in kind else f"graph {graph.name!r}"


def _accumulating(recorder: Any) -> bool:
    return isinstance(recorder, forwardprop.ForwardAccumulator) and bool(recorder._recording)


def run_segment(name: str, run: Callable[..., Any], args: Sequence[Any], returns: bool = True) -> Any:
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
    log = TouchLog(owners, scope.key)
    refusals = Refusals(name, paused, args, log, scope.key)
    try:
        # (inside the try whose finally resumes them: an interrupt among the
        # pauses would leave the user's tapes not recording)
        for r in paused:
            r.pause()
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
        # The creator and watcher scopes, exited in the finally below (an
        # interrupt as a ``with`` block ends would leave them entered).
        entered = contextlib.ExitStack()
        try:
            # (inside the try whose finally undoes them: an interrupt between
            # would leave the callback, and through it the tapes, behind)
            scope.owners = log
            op_callbacks.add_op_callback(refusals.callback)
            entered.enter_context(tf.variable_creator_scope(refusals.creator))
            watcher = entered.enter_context(record.VariableWatcher())
            result = run(*args)
            # The variables TensorFlow's tapes would have watched (read through
            # the variable, not only by a raw op on a kept handle: 6d).
            accessed = {v._unique_id for v in watcher.watched_variables() if hasattr(v, "_unique_id")}
            # Refused once the step has returned: a variable it created (whose
            # maker finished making it), a copy that failed.
            error, log.error = (
                refusals.deferred() or log.error,
                None,
            )  # (kept, it would hold its traceback's frames: a cycle)
            if error is not None:
                refusals.refused = True
                try:
                    raise error
                finally:
                    del error
            if graph is not None:
                refusals.scan(graph, start)
        except BaseException:
            if refusals.refused:
                # Refused: the variables and the tapes as before the step, as
                # a refused write leaves them.
                for var, value in log.touched.values():
                    if value is not None and var._unique_id not in refusals.created_ids:
                        assign(var, value)
                _forget_inner_versions(scope, before, paused, lengths)
            else:
                # The step's own error, or an interrupt: its writes stay, as
                # without the wrapper, and the tapes keep the versions they
                # made, as writes under their stop_recording() (a failed step
                # is not recorded).
                owners.update(log)
            log.error = None  # (a cycle through its traceback)
            raise
        finally:
            # (One line: an interrupt there has it run once more, as a tape's exit does.)
            try: _restore(scope, owners, refusals.callback, entered)  # noqa: E701  # fmt: skip
            except BaseException:
                _restore(scope, owners, refusals.callback, entered)
                raise
    finally:
        resume(paused)
    after = dict(scope.current)
    wrote = {uid: _wrote(paused, lengths, uid) for uid in log.touched}
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
        if not is_float(var.dtype):
            continue
        inputs.append(var)
        starts.append(entry.get(uid, _versions.canonical_handle(var)))
        if after.get(uid) is not entry.get(uid) if wrote[uid] is None else wrote[uid]:
            written.append(var)
    flat = nest.flatten(result)
    # A returned tensor that existed before the step (an argument, one it
    # closes over) is itself, with its own gradient path: not the op's output.
    made = {id(op) for op in graph.get_operations()[start:]} if graph is not None else set()
    float_out = [
        i
        for i, t in enumerate(flat)
        if returns and float_tensor(t) and (t._id >= start if graph is None else id(t.op) in made)
    ]
    tensors = [a for a in args if float_tensor(a)]
    segment = Segment(name, run, args, log.touched, inputs, written, float_out)
    # Read only by a raw op on a kept handle (semantics 6d: TensorFlow watches
    # nothing for it), not through the variable, and not written: the re-run
    # does not watch it up front either. (A variable an op writes through its
    # handle, an optimizer's slot, is tracked by its writes, watched or not.)
    segment.unwatched = {uid for uid in log.touched if uid not in accessed} - {v._unique_id for v in written}
    segment.prints = fingerprints(written, [flat[i] for i in float_out])
    # Watched as the step's reads would have them watched (the versions at
    # its start), before the new versions are made current.
    for var, _ in log.touched.values():  # (all, as the reads would: watched_variables lists them)
        _writes.watch(scope, var)
    ends = [_versions.new_version(after[var._unique_id], None) for var in written]
    outputs = [*ends, *(flat[i] for i in float_out)]
    segment.ends = outputs
    record.record_operation_backprop_only(_WRITE, outputs, [*starts, *tensors], segment.backward)
    for var, end in zip(written, ends):
        scope.advance(var, scope.current_version(var), end, WriteRecord(_WRITE))
    return result


def _wrote(records: List[Any], lengths: List[Dict[str, int]], uid: str) -> Optional[bool]:
    """Whether the segment wrote the variable of ``uid``: a write noted on
    the paused tapes' records since the segment's start (``lengths``). Not
    the version its first read made of a variable written while a tape here
    was closed, or that a tape entered again goes on from
    (``cut_on_first_read``, rule 6): a read, whose version is the segment's
    start, not its end. None where no record keeps its writes."""
    for r, known in zip(records, lengths):
        if r.keeps_history:
            new = r.writes.get(uid, [])[max(known.get(uid, 0) - 1, 0) :]
            return any(w.op not in _RESOLVES for w in new)
    return None


# What ``cut_on_first_read`` notes on a record for the version it makes.
_RESOLVES = frozenset([CLOSED_WRITE.op, "Identity"])


def _restore(scope: _versions.Scope, owners: Dict[int, Any], callback: Any, entered: contextlib.ExitStack[Any]) -> None:
    """The scope's owners, TensorFlow's op callbacks and the scopes
    ``entered`` as before the segment (again: no change)."""
    leave(entered)
    scope.owners = owners
    remove_callback(callback)


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
      A callable taking ``fn``'s arguments that can be given by position,
      by position or by name (``fn`` is called with them by position, a
      parameter left out before one named with its default), and returning
      what ``fn`` returns. A keyword-only argument is a ``TypeError``: wrap
      a function that passes it (``checkpointed(lambda x: fn(x, c=c))``).

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
    try:
        signature: Optional[inspect.Signature] = inspect.signature(fn)
    except (TypeError, ValueError):  # (a callable Python cannot describe: positional only)
        signature = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            args = _positional(name, signature, args, kwargs)
        return run_segment(name, fn, args)

    if signature is not None:
        # What the wrapper takes: ``fn``'s parameters that can be given by position.
        call.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[p for p in signature.parameters.values() if p.kind not in _KEYWORD_ONLY]
        )
    return call


_KEYWORD_ONLY = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)


def _positional(name: str, signature: Optional[inspect.Signature], args: Any, kwargs: Dict[str, Any]) -> Any:
    """``args`` and ``kwargs`` bound to ``signature`` as the step's
    positional arguments (a parameter left out before one given: its
    default): the segment and its re-run call the step with positional
    arguments only. A TypeError for what cannot be given by position."""
    fix = "pass them by position, or wrap a function that takes them so: checkpointed(lambda x: step(x, c=c))"
    if signature is None:
        raise TypeError(f"{name} takes positional arguments only (got {sorted(kwargs)}): {fix}.")
    try:
        given = signature.bind(*args, **kwargs).arguments
    except TypeError as error:
        raise TypeError(f"{name}: {error}") from None
    params = signature.parameters.values()
    refused = sorted(p.name for p in params if p.kind in _KEYWORD_ONLY and p.name in given)
    if refused:
        raise TypeError(f"{name} passes the step's arguments by position: it cannot pass {refused}; {fix}.")
    positional = [p for p in params if p.kind not in _KEYWORD_ONLY]
    last = max(i for i, p in enumerate(positional) if p.name in given)
    found: List[Any] = []
    for p in positional[: last + 1]:
        if p.kind == inspect.Parameter.VAR_POSITIONAL:
            found.extend(given.get(p.name, ()))
        else:
            found.append(given[p.name] if p.name in given else p.default)
    return tuple(found)
