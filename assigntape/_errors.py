"""The library's own exceptions.

Each one narrows a built-in error, so code that already catches ``TypeError`` or
``NotImplementedError`` keeps working, and code that wants only ours catches
``AssignTapeError``.
"""

from __future__ import annotations

__all__ = [
    "AssignTapeError",
    "ControlFlowWriteError",
    "DuplicateIndicesError",
    "ForkedTapeError",
    "GraphWriteOrderError",
    "NotAVariableError",
    "RecomputeError",
    "SavedModelError",
    "UntrackedWriteError",
    "WriteDtypeError",
]


class AssignTapeError(Exception):
    """Base class for every error raised by assigntape itself."""

    # AutoGraph re-raises an error from traced code as its own type only when
    # that type's __init__ is Exception's; otherwise the user gets a StagingError.
    __init__ = Exception.__init__


class NotAVariableError(AssignTapeError, TypeError):
    """An API that takes a variable was given something else, or ``gradient``
    a ``ShardedVariable`` (give its shards, ``v.variables``)."""


class ControlFlowWriteError(AssignTapeError, NotImplementedError):
    """A tracked variable was written inside a graph body the tape cannot follow.

    The tape follows writes in ``tf.cond`` branches and graph loops (carrying
    the variable as loop state), and traces a ``tf.function`` that writes,
    called inside the tape's function, inline. A version made in another body
    (a concrete function called there, ``tf.switch_case``) cannot leave it,
    so the tape cannot carry the new version to later reads.
    Likewise a write on a tape opened inside a compiled cond branch or loop
    body while a plain ``tf.GradientTape`` or ``ForwardAccumulator`` records
    around that body: make the outer tape an ``AssignAwareTape``.

    Forward mode through compiled control flow where TensorFlow's own forward
    mode cannot go is refused the same way, while tracing: a graph loop body
    that reads a variable a ``ForwardAccumulator`` has a tangent for without
    writing it, and a loop or cond whose forward mode fails in TensorFlow
    (the message names TensorFlow's error and what to do instead). So is the
    gradient of a non-persistent tape that recorded a cond or loop and was
    recording while ``tf.gradients`` (or another tape's gradient) went
    through it: second order through ``tf.gradients``, which the tape cannot
    see whole (a persistent tape, or a tape inside the tape, can).
    """


class GraphWriteOrderError(AssignTapeError, NotImplementedError):
    """A floating-point variable was written, while a tape is open in the
    thread, in a graph with no automatic control dependencies: a TF1 graph
    (``tf.Graph().as_default()`` run by a ``tf.compat.v1.Session``, its
    ``tf.cond`` and ``tf.while_loop`` bodies, TF1 control flow included) or a
    ``tf.compat.v1.wrap_function``.

    There ops run in no build order and a write nothing depends on is pruned,
    so the order of the writes is not known when the graph is built, and the
    tape's versions (which assume build order is run order, as a
    ``tf.function`` guarantees) could be silently wrong. Build the program in
    a ``tf.function``, or make the write outside every tape.
    """


class DuplicateIndicesError(AssignTapeError, ValueError):
    """A scatter write whose gradient would depend on how duplicates combine.

    ``scatter_update`` with duplicate indices leaves the written value undefined;
    ``scatter_mul`` / ``div`` / ``min`` / ``max`` combine duplicates in ways the tape
    does not differentiate. ``scatter_add`` / ``scatter_sub`` sum them and are fine.
    """


class UntrackedWriteError(AssignTapeError, RuntimeError):
    """A tracked variable was written by an op the tape cannot differentiate.

    After such a write, reads would credit the version before it and the gradient
    would be silently wrong, so the tape refuses. Pass
    ``AssignAwareTape(untracked_writes="cut")`` to treat the write as a new
    version with no gradient path instead (with a warning).
    """


class WriteDtypeError(AssignTapeError, TypeError):
    """A write op whose kernel aborts the process on a value of another
    dtype than the variable's was given one: a fused optimizer kernel
    (``tf.raw_ops.ResourceApply*``), or ``ResourceScatterNd*``.

    Outside a tape TensorFlow 2.21 raises ``TypeError`` where such a fused
    kernel's inputs do not convert to one dtype, and where they do, the
    kernel aborts the process. Inside a tape either is this error, raised
    before anything is written. Give the values as tensors of the
    variable's dtype.
    """


class SavedModelError(AssignTapeError, ValueError):
    """A SavedModel cannot carry the gradient of an AssignAwareTape's writes.

    Inside a ``tf.function``, each write the tape follows is a version op whose
    gradient rule is Python code kept beside the graph. ``tf.saved_model.save``
    with custom gradients (its default) would have to save those rules, and
    is refused; saved with ``SaveOptions(experimental_custom_gradients=False)``,
    the loaded function computes the same values (its own tape's gradients
    included), and a gradient *through* it, which would need the rules, is
    refused with this error rather than silently cut at each write.
    """


class ForkedTapeError(AssignTapeError, RuntimeError):
    """A tape closed by another thread before ``os.fork`` was entered again in
    the forked child, where the writes made while it was closed were not
    followed for it. Open a new tape in the child."""


class RecomputeError(AssignTapeError, RuntimeError):
    """A ``checkpointed`` or ``unroll`` step that its re-run in the backward
    pass could not reproduce, or that the tape could not record as one segment.

    A segment keeps only the values of the variables it touched at its start
    and runs the step again to differentiate it, so the step must compute the
    same thing again from them: no stateful random op that draws without a
    generator (``tf.random.uniform``: use ``tf.random.Generator`` or a Keras
    ``SeedGenerator``, whose state is a variable), no variable created inside
    it (build the optimizer and the model before), no Python side effect that
    changes which variables the next call touches, no plain
    ``tf.GradientTape`` recording around it, and, in a ``tf.function``, a
    Python int number of steps.
    """
