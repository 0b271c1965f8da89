"""A checkpointed segment's recorded op: its backward pass runs the step again.

The op's backward function (``Segment.backward``) puts the checkpoint back in
the variables, runs the step again under a fresh ``AssignAwareTape`` (the
scope set aside), differentiates it from its start to its ends, checks that
the re-run computed what the first run did (fingerprints), and puts the
variables back as they were.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import tensorflow as tf

from assigntape import _registry, _threads
from assigntape._errors import RecomputeError, UntrackedWriteError
from assigntape._segment_checks import (
    Refusals,
    TouchLog,
    assign,
    float_tensor,
    is_float,
    leave,
    read,
    remove_callback,
    resume,
)
from assigntape._tape import AssignAwareTape
from assigntape._tf import indexed_slices, nest, op_callbacks, ops, record, tensor_lib


class Segment:
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
        # its end, then of each float tensor returned (``fingerprints``).
        self.prints: List[Any] = []
        # The recorded op's outputs: a tape that saw the segment reaches its
        # sources through them (``_refuse_second_order``).
        self.ends: List[Any] = []
        # Variables the re-run's tape does not watch up front (``TouchLog.raw``).
        self.unwatched: Set[str] = set()

    def backward(self, *upstream: Any) -> List[Any]:
        """The gradients for the recorded op's inputs (the versions of
        ``inputs`` at the segment's start, then the float tensor arguments)
        from those of its outputs (the new versions of ``written``, then the
        float tensors returned)."""
        key = _registry.current_key()
        scopes = _registry._scopes()
        outer, paused = None, []
        try:
            # (inside the try whose finally puts them back: an interrupt
            # before it would leave the tape's scope gone, its tapes paused)
            outer = scopes.pop(key, None)
            paused = [r for r in outer.records if r.recording()] if outer is not None else []
            for r in paused:
                r.pause()
            self._refuse_other_threads()
            saved = [(var, read(var)) for var, _ in self.touched.values()]
            try:
                grads = self._differentiate(upstream)
            finally:
                for var, value in saved:
                    assign(var, value)
        except UntrackedWriteError as error:
            # (a tape opened in another thread meanwhile, or one reading a
            # variable the check above could not name)
            raise RecomputeError(_other_thread_message(self.name, str(error))) from error
        finally:
            resume(paused)
            if outer is not None:
                scopes[key] = outer
        return self._refuse_second_order(grads, upstream)

    def _refuse_other_threads(self) -> None:
        """Refuses the backward pass, before it writes anything, if a tape
        open in another thread has read or written a variable the segment
        touched: the re-run writes the checkpoint and the step's values into
        the live variables (the write would be refused anyway, as a write
        from another thread, with advice that does not apply here)."""
        for var, _ in self.touched.values():
            if _threads.tracked_in_other_thread(var.__dict__["_handle"], var) is not None and is_float(var.dtype):
                raise RecomputeError(
                    _other_thread_message(self.name, f"an AssignAwareTape open in another thread read {var.name!r}")
                )

    def _refuse_second_order(self, grads: List[Any], upstream: Sequence[Any]) -> List[Any]:
        """``grads`` through an identity whose own gradient (and tangent)
        raises: the re-run ran with every recorder paused, so a tape or
        accumulator recording this backward pass (an outer tape, a persistent
        tape inside its block, ``jacobian`` of a gradient, forward over
        reverse) does not see how the gradients depend on the segment's start
        or on ``upstream``, and would get a silently wrong (often None) second
        derivative. Recorded where a recorder reaches the identity's inputs
        (the gradients flowing in, the segment's outputs): a first-order
        gradient never differentiates it. In a graph always: ``tf.gradients``
        (symbolic, no recorder) may differentiate the gradient's graph later,
        and its walk reaches the identity through the re-run's reads of the
        variables, whose handles are the sources it is given."""
        given = [g for g in grads if g is not None]
        recording = record.could_possibly_record()
        if not given or (not recording and tf.executing_eagerly()):
            return grads
        refuse = functools.partial(_refuse_second_order, self.name)
        # The written variables' new versions are handles: connected on the
        # tapes only (TensorFlow's forward mode takes no resource input; an
        # accumulator entered after the segment gives them no tangent anyway).
        handles = [t for t in self.ends if not float_tensor(t)]
        if handles and recording:
            with record.stop_recording():
                passed = [tf.identity(g) for g in given]
            record.record_operation_backprop_only(_SECOND_ORDER, passed, [*given, *handles], refuse)
            given = passed
        floats = [t for t in [*upstream, *self.ends] if float_tensor(t)]

        @tf.custom_gradient
        def guard(*xs: Any) -> Any:
            return [tf.identity(x) for x in xs[: len(given)]], refuse

        guarded = iter(guard(*given, *floats))
        return [None if g is None else next(guarded) for g in grads]

    def _differentiate(self, upstream: Sequence[Any]) -> List[Any]:
        # In a graph, the re-run starts once the gradients it is given are
        # computed (the segment after it done): else the executor may run
        # every segment's re-run ahead at once, holding all their activations.
        given = [g for g in upstream if isinstance(g, tensor_lib.Tensor) and not isinstance(g, ops.EagerTensor)]
        with ops.control_dependencies(given):
            for var, value in self.touched.values():
                assign(var, value)
        tensors = [a for a in self.args if float_tensor(a)]
        # The re-run's tape, exited in the finally (not by a ``with``: an
        # interrupt as its block ends, before its exit is called, would leave
        # it open for the process, and no user object could close it).
        entered = contextlib.ExitStack()
        try:
            tape = entered.enter_context(AssignAwareTape())
            scope = tape._scope
            assert scope is not None
            log = scope.owners = TouchLog(scope.owners, scope.key)
            for var in self.inputs:
                if var._unique_id not in self.unwatched:
                    tape.watch(var)
            tape.watch(tensors)
            notes = Refusals(self.name, [], self.args, log, scope.key)
            result = _run_noted(notes, self.run, self.args)
        finally:
            # (One line: an interrupt there has it run once more, as a tape's exit does.)
            try: leave(entered)  # noqa: E701  # fmt: skip
            except BaseException:
                leave(entered)
                raise
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
        asserts, same = check
        # The gradients' graph run fails where the re-run differs; under XLA,
        # which drops assertions, every element of every gradient is NaN. In
        # every graph: whether XLA will compile it cannot be told here (a
        # function traced without XLA, its trace cached, is compiled by an
        # outer jit_compile function that calls it later; TF 2.16 and 2.21).
        with ops.control_dependencies(asserts), record.stop_recording():
            return [None if g is None else _nan_unless(same, g) for g in grads]

    def _check_same(self, flat: List[Any]) -> Optional[Tuple[List[Any], Any]]:
        """The re-run's ends compared with the first run's (fingerprints): a
        stateful op whose state no variable holds (not refused up front: an
        iterator, a py_function drawing random numbers, ...) makes them
        differ. Eagerly a ``RecomputeError``; in a graph, assertions for the
        gradients to depend on and whether all are the same (a scalar bool
        tensor), or None eagerly."""
        names = [f"the variable {v.name!r}" for v in self.written]
        names += [f"its returned tensor {i} (of nest.flatten)" for i in self.float_out]
        again = fingerprints(self.written, [flat[i] for i in self.float_out])
        checks: List[Any] = []
        alike: List[Any] = []
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
                tol = _rtol(dtype) * tf.stack([first[1], first[1], first[2], first[1]]) + _TINY
                # Equal covers infinities (inf - inf is NaN); a NaN anywhere, no check.
                close = tf.equal(first, second) | (tf.abs(first - second) <= tol)
                same = tf.reduce_all(close) | tf.reduce_any(tf.math.is_nan(first))
                if tf.executing_eagerly():
                    if not bool(same):
                        raise RecomputeError(message)
                else:
                    checks.append(tf.debugging.Assert(same, [message]))
                    alike.append(same)
        if not checks:
            return None
        with record.stop_recording():
            return checks, tf.reduce_all(tf.stack(alike))


_TINY = 1e-30


def _run_noted(notes: Refusals, run: Callable[..., Any], args: Sequence[Any]) -> Any:
    """``run(*args)`` with ``notes`` noting the variables it touches. (Its
    own function: an interrupt at a ``try`` line directly in a ``with``
    block skips the block's exit, here the re-run tape's.)"""
    try:
        op_callbacks.add_op_callback(notes.callback)
        return run(*args)
    finally:
        # (One line: an interrupt there has it run once more, as a tape's exit does.)
        try: remove_callback(notes.callback)  # noqa: E701  # fmt: skip
        except BaseException:
            remove_callback(notes.callback)
            raise


def _other_thread_message(name: str, found: str) -> str:
    return (
        f"{name}: its gradient runs the step again, writing its checkpoint and the step's values "
        f"into the variables it touched until the backward pass puts them back, but {found}: "
        "that tape would read the values written meanwhile. Take the gradient when no other "
        "thread's tape reads these variables (synchronize the threads), or call the step without "
        "checkpointed / unroll there."
    )


_SECOND_ORDER = "CheckpointedGradient"


def _refuse_second_order(name: str, *_: Any, **__: Any) -> Any:
    raise RecomputeError(
        f"{name}: a gradient through this segment is being differentiated again (a second-order "
        "derivative: a tape or tape.jacobian around the gradient's computation, tf.gradients of "
        "it, or a ForwardAccumulator over it). The segment's re-run in the backward pass is "
        "recorded by no tape around it, so that derivative would be wrong. Call the step without checkpointed / "
        "unroll where a second-order derivative is taken (or take it by finite differences of "
        "the gradient)."
    )


def fingerprints(variables: List[Any], tensors: List[Any]) -> List[Any]:
    """Per value (each variable's now, then each tensor), float64 [sum,
    sum of absolute values, sum of squares, sum weighted by position]: O(1)
    memory kept, the same for the same bits. The weights (sin(i + 1), at most
    1 in size: the tolerance of the sum of absolute values holds) make it
    see an order: a permutation (a shuffle drawn again) keeps the other three."""
    found: List[Any] = []
    with record.stop_recording():
        for x in [read(v) for v in variables] + list(tensors):
            if x.dtype.is_complex:
                x = tf.concat([tf.reshape(tf.math.real(x), [-1]), tf.reshape(tf.math.imag(x), [-1])], 0)
            x = tf.reshape(tf.cast(x, tf.float64), [-1])
            weights = tf.sin(tf.range(1, tf.size(x, tf.int64) + 1, dtype=tf.float64))
            sums = [tf.reduce_sum(x), tf.reduce_sum(tf.abs(x)), tf.reduce_sum(x * x), tf.reduce_sum(x * weights)]
            found.append(tf.stack(sums))
    return found


def _rtol(dtype: Any) -> float:
    """The same ops on the same device give the same bits; a little room (a
    few rounding steps of ``dtype``'s, relative to the sum of absolute values)
    for a graph's optimizer rewriting one run and not the other."""
    return 3e-2 if dtype.real_dtype.size <= 2 else 1e-6


def _nan_unless(same: Any, g: Any) -> Any:
    """``g``, or NaN in each of its elements where ``same`` (a scalar) is
    false; an ``IndexedSlices`` stays one."""
    if isinstance(g, indexed_slices.IndexedSlices):
        return indexed_slices.IndexedSlices(_nan_unless(same, g.values), g.indices, g.dense_shape)
    return tf.where(same, g, tf.constant(np.nan, g.dtype))


def _names(a: Dict[str, Tuple[Any, Any]], b: Dict[str, Tuple[Any, Any]], wrote: Set[str], written: List[Any]) -> str:
    found = {uid: var for uid, (var, _) in {**a, **b}.items()}
    differ = (set(a) - set(b)) | (wrote ^ {v._unique_id for v in written})
    return ", ".join(sorted(repr(found[uid].name) for uid in differ if uid in found))
