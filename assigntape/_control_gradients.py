"""The gradients of the conds, cases and loops a tape recorded.

TensorFlow records a graph cond, case or loop bare under one non-persistent
tape, and its gradient may make the op output more than it did when it was
recorded: ``possible_gradient_types`` prepares them for higher order where a
tape of ours records, ``complete_record`` records the added outputs on a tape
that has no record of them, and ``branch_gradient`` / ``loop_gradient`` see a
branch's or body's gradient built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

from assigntape import _graph_gradients, _recorders, _registry
from assigntape._errors import ControlFlowWriteError
from assigntape._tf import (
    context,
    control_flow_util,
    default_gradient,
    gradients_util,
    nest,
    ops,
    pywrap_tfe,
    record,
)
from assigntape._wrapping import bind, params_of


def possible_gradient_types(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``gradients_util.PossibleTapeGradientTypes``, asked by a cond, case or
    loop being built and by a function call, which gradient functions to
    prepare: in the graph where a tape of ours records, always those for
    higher order, as for a persistent tape.

    With one non-persistent tape recording, TensorFlow records a graph cond,
    case, loop or call bare and prepares first-order gradients only. But
    ``tf.gradients`` inside the tape (a gradient penalty, MAML's inner step, a
    Jacobian) makes the op output intermediates after the tape recorded it,
    and the gradient ops the tape records next read them: the tape drops their
    cotangents (a plain tape is then silently wrong, returns None or fails an
    assertion). Prepared for higher order, the op sits in a function call whose
    recorded gradient outputs every intermediate up front."""
    kind = wrapped(*args, **kwargs)
    cond_op = _a_cond_op_asked()
    if kind == gradients_util.POSSIBLE_GRADIENT_TYPES_HIGHER_ORDER and cond_op and _one_tape_beside_one_accumulator():
        return gradients_util.POSSIBLE_GRADIENT_TYPES_FIRST_ORDER
    if kind != gradients_util.POSSIBLE_GRADIENT_TYPES_FIRST_ORDER or context.executing_eagerly():
        return kind
    # Only for ops built in the very graph where a tape of ours records, not
    # in a function traced there (whose trace TensorFlow caches for every
    # later caller) nor in a branch or body (wrapped at every level, pfor
    # cannot vectorize a Jacobian through a cond in a loop or in a cond).
    scope = getattr(_registry._tls, "scopes", {}).get(ops.get_default_graph())
    if scope is None or not any(r.recording() for r in scope.records):
        return kind
    # Not with an accumulator recording (TensorFlow's forward mode through the
    # wrapped op fails to build), nor under XLA for a cond or loop that writes
    # a variable (the wrapped op then fails to build). There the op stays
    # bare, and the tape completes its record of it (``complete_record``).
    # (The recorder's kind matters here for TensorFlow's forward mode, not ours.)
    if _accumulating():
        return kind
    if _building_writes() and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        return kind
    return gradients_util.POSSIBLE_GRADIENT_TYPES_HIGHER_ORDER


# Per thread, for each cond being built (``cond_v2._build_cond``): whether
# TensorFlow has yet to ask which gradients to prepare for its op.
_building_conds = threading.local()


@contextlib.contextmanager
def building_cond() -> Iterator[None]:
    """A cond (``tf.cond``, ``tf.case``) is being built: its branches are
    traced, and the first ``PossibleTapeGradientTypes`` asked now is its op's
    (later ones: the gradients an accumulator builds of it)."""
    stack = _building_conds.__dict__.setdefault("stack", [])
    stack.append([True])
    try:
        yield
    finally:
        stack.pop()


def _a_cond_op_asked() -> bool:
    """Whether this ``PossibleTapeGradientTypes`` is asked for the op of a
    cond being built (``building_cond``), the first asked there."""
    stack = getattr(_building_conds, "stack", None)
    if not stack or not stack[-1][0]:
        return False
    stack[-1][0] = False
    return True


def _one_tape_beside_one_accumulator() -> bool:
    """For a cond's op being made (not a graph loop's, whose forward mode
    TensorFlow fails bare): whether what records in this
    thread's graph is one accumulator and one non-persistent tape of ours
    (besides the internal tape of ``assigntape.ForwardAccumulator``, which
    keeps no history and is never differentiated). There TensorFlow asks for
    higher order as soon as the accumulator has a tangent for an input of
    the cond (a variable written before it, a tensor computed from a watched
    one), and puts the op in a function call (``cflow_gradient_wrapper``)
    whose forward mode drops the tangent entering through a captured
    variable's handle (a silently wrong jvp) or fails on the optionals that
    hold the branches' intermediates (a ``TypeError``, "variant"). Recorded
    bare, as when the accumulator has no tangent for its inputs, the jvp
    through the op is right, and so is the tape's gradient (a second
    derivative through it is refused, ``refuse_lacking``)."""
    if context.executing_eagerly():
        return False
    recorders = [r for r in _recorders.recording_now() if getattr(r.tape, "_keeps_history", True)]
    forward = [r for r in recorders if r.forward]
    reverse = [r for r in recorders if not r.forward]
    return (
        len(forward) == 1
        and len(reverse) == 1
        and reverse[0].ours
        and not getattr(reverse[0].tape, "_persistent", True)
    )


def _accumulating() -> bool:
    """Whether a forward accumulator (TensorFlow's or ours) records in this thread."""
    return any(r.forward for r in _recorders.recording_now())


def _building_writes() -> bool:
    """Whether a cond whose branches write, or a loop that carries written
    variables, is being built in this thread."""
    return bool(getattr(_carrying_now, "depth", 0)) or any(b.values for branches in _pending for b in branches)


# How many AssignAwareTape gradients this thread is computing (``branch_gradient``).
_differentiating = threading.local()


def differentiating(delta: int) -> None:
    """Counts this thread into (``+1``) or out of (``-1``) an AssignAwareTape's gradient."""
    _differentiating.depth = getattr(_differentiating, "depth", 0) + delta


# Branch and body graphs of the conds, cases and loops built through ``cond``,
# ``indexed_case`` and ``while_loop`` -> (a weak reference to the op, its number
# of outputs then, the non-persistent tapes of ours that recorded it bare):
# ``_note_recorders``, read by ``_note_gradient``.
_built_under: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

_CONTROL_OPS = ("If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase")


def _control_op(tensors: Any) -> Any:
    """The If or While op that produced ``tensors`` (directly or through the
    identities cond_v2 and while_v2 put after it), or None (TensorFlow wrapped
    it in a function call, or there are no outputs)."""
    for t in nest.flatten(tensors, expand_composites=True):
        op = getattr(t, "op", None)
        if op is None:
            continue
        if op.type in _CONTROL_OPS:
            return op
        if op.type == "Identity" and op.inputs and op.inputs[0].op.type in _CONTROL_OPS:
            return op.inputs[0].op
    return None


# The call op TensorFlow puts around a cond or loop when a persistent
# recorder, or more than one, could differentiate it
# (``control_flow_util_v2.run_as_function_for_tape_gradients``).
_WRAPPER = "cflow_gradient_wrapper"


def _wrapper_call(tensors: Any) -> Any:
    """The call op of a ``cflow_gradient_wrapper`` function that produced
    ``tensors`` (directly or through an identity), or None."""
    for t in nest.flatten(tensors, expand_composites=True):
        op = getattr(t, "op", None)
        if op is not None and op.type == "Identity" and op.inputs:
            op = op.inputs[0].op
        if op is None or op.type not in ("StatefulPartitionedCall", "PartitionedCall"):
            continue
        name = op.get_attr("f").name
        if _WRAPPER in (name.decode() if isinstance(name, bytes) else name):
            return op
    return None


def refuse_forward_through_wrapper(tensors: Any, written: List[Any], what: str) -> None:
    """A cond or graph loop that writes ``written`` was just built (its outputs
    ``tensors``) while a forward accumulator records and has a tangent for
    one of its inputs, and TensorFlow put it inside a function call, as it
    does when a persistent recorder or more than one could differentiate it
    (a persistent tape of ours, a plain tape beside or around, a tape inside
    another). TensorFlow's forward mode through that call may drop the
    tangent of every output (seen when the tangent enters only through a
    captured variable's handle: a None jvp for a cond that only reads, in
    plain TensorFlow too; with a write, its version's tangent is lost, a
    silently wrong jvp). Refused while tracing when no output of the call got
    a tangent, nothing run. (With one non-persistent tape TensorFlow records
    the op bare, and its forward mode through it is right.)"""
    if not written or not _accumulating():
        return
    call = _wrapper_call(tensors)
    if call is None or not pywrap_tfe.TFE_Py_PackJVPs(list(call.inputs))[1]:
        return
    # Some such calls do carry tangents out (a Keras EMA overwrite was
    # right): refused only where none of the outputs got one.
    if pywrap_tfe.TFE_Py_PackJVPs(list(call.outputs))[1]:
        return
    names = ", ".join(sorted({repr(var.name) for var in written}))
    raise ControlFlowWriteError(
        f"Forward mode through a {what} that writes {names} ({call.name!r}), with a persistent tape "
        "or more than one tape recording beside the ForwardAccumulator: TensorFlow then puts the "
        f"{what} inside a function call, and its forward mode through that call dropped the tangent "
        "of what the branches compute (a None or silently wrong jvp; plain TensorFlow drops it "
        "too for a cond that only reads), nothing ran. Record it with a single non-persistent "
        "AssignAwareTape beside the accumulator (or the accumulator alone), branch in Python, "
        "or take the gradient in reverse mode."
    )


@contextlib.contextmanager
def _paused(recorder: _recorders.Recorder) -> Iterator[None]:
    recorder.pause()
    try:
        yield
    finally:
        recorder.resume()


@contextlib.contextmanager
def _alone(others: List[Any]) -> Iterator[None]:
    """``others`` (recorders) set aside: what records now is what is left."""
    with contextlib.ExitStack() as stack:
        for other in others:
            stack.enter_context(_paused(other))
        yield


def _records_alone(recorder: Any, others: List[Any], inputs: List[Any]) -> bool:
    """Whether ``recorder`` alone records an op of ``inputs`` (the others set aside)."""
    with _alone(others):
        return bool(pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop(inputs))


def _note_recorders(tensors: Any, graphs: List[Any]) -> None:
    """A cond, case or loop was built, with branch or body ``graphs``: which
    non-persistent tapes of ours recorded its op bare (TensorFlow wraps it in
    a function when a persistent tape or more than one could differentiate
    it; a tape differentiates such a call whole)."""
    op = _control_op(tensors)
    if op is None or pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return
    inputs = list(op.inputs)
    # (Accumulators left out: TensorFlow's forward mode, not a tape, records the op.)
    recorders = [r for r in _recorders.recording_now() if not r.forward]
    ours = [r for r in recorders if r.ours and not getattr(r.tape, "_persistent", True)]
    if not ours or not pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop(inputs):
        return
    recorded = [r for r in ours if _records_alone(r, [o for o in recorders if o is not r], inputs)]
    if recorded:
        # (A weak reference to the op: a value of _built_under must not keep its key.)
        noted = (weakref.ref(op), len(op.outputs), weakref.WeakSet(recorded))
        for graph in graphs:
            _built_under[graph] = noted


def _note_gradient(graph: Any) -> None:
    """The gradient of the cond, case or loop of ``graph`` (a branch or body)
    is being built. A tape that recorded the op bare and records now records
    the ops of that gradient, which may read outputs the gradient adds to the
    op after the tape recorded it, which the tape has no record of (a plain
    tape fails an assertion there, or is silently wrong). The op is noted on
    the tape's record, for ``complete_record``. (An op no tape of ours
    recorded bare is not noted: built before the tape, or inside a function
    TensorFlow wrapped it in.)"""
    noted = _built_under.get(graph)
    if noted is None or not record.could_possibly_record() or pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return
    op_ref, count, recorded = noted
    for found in _recorders.recording_now():
        if found in recorded:
            found.suspects.setdefault(id(op_ref), (op_ref, count))


def complete_record(found: Any) -> None:
    """Before ``found`` (a tape's record) is differentiated: the conds, cases
    and loops it recorded bare in this graph whose gradient, built while it
    recorded, made the op output more than it did when recorded.

    The tape has no record of those outputs, which the gradient ops it
    recorded read: a plain tape drops their cotangents (silently wrong where
    they depend on what it differentiates: a branch's ``sin(x) * x`` outputs
    ``sin(x)``) or fails an assertion. They are recorded now, on this tape
    alone, as made from the op's inputs by the op, with the op's own gradient
    (zero cotangents for the other outputs); the gradient through the op is
    then the sum of the two records', which is the op's gradient. A loop's
    gradient gives no cotangent to the outputs an earlier gradient added, so
    for a loop that record refuses, if the tape's gradient reaches it.
    """
    graph = ops.get_default_graph()
    for key, (op_ref, count) in list(found.suspects.items()):
        op = op_ref()
        if op is None or op.graph is not graph or len(op.outputs) <= count:
            continue
        found.suspects[key] = (op_ref, len(op.outputs))
        _record_outputs(found, op, count, len(op.outputs))


def _record_outputs(found: Any, op: Any, start: int, stop: int) -> None:
    """Records ``op.outputs[start:stop]`` on the tape of ``found`` alone."""
    added = op.outputs[start:stop]

    def backward(*grads: Any) -> Any:
        if op.type in ("While", "StatelessWhile"):
            raise ControlFlowWriteError(
                f"tf.gradients (or another tape's gradient) went through the graph loop {op.name!r} "
                "while this tape recorded, and this tape's gradient goes through what it computed, as "
                "for a second derivative or a gradient penalty. TensorFlow made the loop output "
                "intermediates after the tape recorded it, and its loop gradient gives them no "
                "cotangent (a plain tf.GradientTape is silently wrong here). Make this tape "
                "persistent=True, or take the inner gradient with a tape inside this one instead "
                "of tf.gradients."
            )
        outputs = op.outputs
        cotangents = [default_gradient.zeros_like(t) for t in outputs[:start]]
        cotangents += [default_gradient.zeros_like(t) if g is None else g for t, g in zip(added, grads)]
        cotangents += [default_gradient.zeros_like(t) for t in outputs[stop:]]
        return ops.get_gradient_function(op)(op, *cotangents)

    tape = found.tape
    others = [r for r in _recorders.recording_now() if r is not found and not r.forward]
    with _alone(others), contextlib.ExitStack() as stack:
        if not found.recording():  # closed: on its tape for this record only
            tape._push_tape()
            stack.callback(tape._pop_tape)
        record.record_operation_backprop_only(op.type, added, list(op.inputs), backward)


def branch_gradient(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2._grad_fn(func_graph, grads)``, the gradient of one branch of a
    cond, when a tape of ours asks it with fewer cotangents than the branch
    has outputs.

    That happens when ``tf.gradients`` went through the cond first: it made the
    If op output the intermediates its gradient reads, after a tape had recorded
    the op with the outputs it had then. TensorFlow then fails an assertion (a
    plain tape does too, with no variable: its own bug, left as it is outside
    our gradients). The branch is differentiated from the outputs the tape saw,
    with zero cotangents for the extra ones: the cotangents they do get, if the
    tape recorded ops reading them, flow through a record of their own
    (``complete_record``), and the op's gradient is the sum of the two.)"""
    func_graph, grads = bind(_params(wrapped), args, kwargs).values()
    outputs = func_graph.outputs
    _note_gradient(func_graph)
    _note_later_gradient(getattr(func_graph, "_forward_cond", None))
    if len(outputs) < len(grads) and _accumulating():
        # Seen for tf.gradients through a cond whose branch writes, under a
        # tape of ours inside a recording accumulator: the accumulator's jvp
        # rewrote the cond, and TensorFlow's own assertion would fail bare.
        raise ControlFlowWriteError(
            f"A reverse gradient (a tape's, or tf.gradients) through the tf.cond branch {func_graph.name!r} "
            "while a ForwardAccumulator records: its forward mode already differentiated this cond, "
            "and TensorFlow cannot build a second gradient of it here (a bare AssertionError). Take "
            "the jvp and the reverse gradient in separate calls (each alone is right); with the "
            "accumulator outside a tf.function whose tape takes the gradient, call the function once "
            "before opening it (traced outside the accumulator, it is differentiated right)."
        )
    # (Under an accumulator, TensorFlow's forward mode through the branch's
    # gradient can fail bare while the gradient is built: refused by name.)
    with refusing_forward_mode_failures(_BRANCH_GRADIENT, _SECOND_ORDER_INSTEAD):
        if len(outputs) <= len(grads) or not getattr(_differentiating, "depth", 0):
            return wrapped(*args, **kwargs)
        # ``_grad_fn`` pairs ``func_graph.outputs`` with ``grads`` and reads nothing
        # else of them; the graph is shown its first outputs only while it does.
        func_graph.outputs = outputs[: len(grads)]
        try:
            return wrapped(func_graph, grads)
        finally:
            func_graph.outputs = outputs


_BRANCH_GRADIENT = (
    "A reverse gradient through a compiled tf.cond or case, built while a ForwardAccumulator records "
    "(forward over reverse, as for a Hessian-vector product)"
)


def loop_gradient(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``while_v2._create_grad_func``, called by the gradient of a While op:
    noted (``_note_gradient``). (TensorFlow gives no cotangent to the outputs
    an earlier gradient added to the op, which is right unless a tape
    recorded ops reading them: such a tape of ours refuses, ``complete_record``.)"""
    body = bind(_params(wrapped), args, kwargs)["body_graph"]
    _note_gradient(body)
    _note_later_gradient(getattr(body, "_while", None))
    try:
        return wrapped(*args, **kwargs)
    except ValueError as error:
        # Seen when tf.gradients went through a graph loop inside this loop's
        # body and the body writes a variable: the inner gradient reads the
        # write's version handle, made in the body (plain TF has no such handle).
        if "creates a resource in its body" not in str(error) or body not in _writing_bodies:
            raise
        raise ControlFlowWriteError(
            f"TensorFlow cannot differentiate the graph loop {body.name!r}: its body makes a "
            "resource that the gradient needs, as when tf.gradients goes through a graph loop "
            "inside a loop body that writes a variable. Take that inner gradient with a tape "
            "opened inside the loop body instead of tf.gradients."
        ) from error


def made_from(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``control_flow_util_v2.get_func_graph(op, input_shapes, func_name)``,
    which the gradient of a cond, case or loop (``cond_v2.get_func_graphs``,
    ``while_v2._get_graph``) calls for a branch or body graph the op does not
    keep: the very graph the function was made from, while it still is that
    function, instead of a new copy of it.

    The op keeps its graphs (``_true_graph``, ``_branch_graph_i``,
    ``_body_graph``) only once it is made, but an accumulator recording builds
    its gradient (the jvp's) as it is made: that gradient got a copy, and when
    the branch's intermediates had to become outputs it extended the copy,
    renamed it ``..._rewritten``, registered it and gave the op its outputs.
    The graph the op then keeps is the original, unchanged: a later gradient
    (``tape.gradient``, ``tf.gradients``, ``jacobian``) saw fewer outputs than
    the op has (tf.gradients: a bare AssertionError), and its own rewrite
    registered a second ``..._rewritten`` function with other contents
    (TensorFlow's "Attempting to add a duplicate function"; plain TensorFlow
    fails the same way). Given the original, the jvp's rewrite is made on the
    graph the op keeps, and every later gradient builds on it."""
    op, _, name = bind(_params(wrapped), args, kwargs).values()
    graph = op.graph
    while graph is not None:
        function = graph._get_function(name)
        if function is not None:
            break
        graph = getattr(graph, "outer_graph", None)
    else:
        return wrapped(*args, **kwargs)
    # (An AtomicFunction keeps the FuncGraph it was made from; a function
    # imported or loaded has none.) Still that function: not renamed by a
    # rewrite since, and made in the op's graph, not copied from another.
    original = getattr(function, "_cached_graph", None)
    if original is None or original.name != name or getattr(original, "outer_graph", None) is not op.graph:
        return wrapped(*args, **kwargs)
    # Only for an op first differentiated while a tape of ours is open (then
    # every later gradient of it too): outside every tape, TensorFlow's own
    # behaviour, its failures included (e.g. XLA's on a jvp through a cond).
    noted = _made_from_original.get(op)
    if noted is None:
        if not _registry.open_here():
            return wrapped(*args, **kwargs)
        noted = _made_from_original[op] = _MadeFrom()
    if _accumulating() and noted.outputs is None:
        noted.outputs = len(op.outputs)
    return original


@dataclasses.dataclass
class _MadeFrom:
    """What is known of a cond, case or loop whose gradients ``made_from``
    gives their own graphs (it holds no reference to the op, its key)."""

    # If an accumulator differentiated the op as it was made: how many outputs
    # it had then, which got tangents, and which the tapes recording it then
    # recorded. A gradient built later makes the op output more (its
    # intermediates), which have neither.
    outputs: Optional[int] = None
    # Once such an op's gradient was built again later (a tape's,
    # tf.gradients): the ids of the ops that read those outputs before, the
    # jvp's own gradient (which computes the op's tangents, from the outputs
    # it made for itself).
    read_by_the_jvp: Optional[Set[int]] = None


# The cond, case and loop ops whose gradients ``made_from`` gave their own
# graphs, and what is known of each.
_made_from_original: "weakref.WeakKeyDictionary[Any, _MadeFrom]" = weakref.WeakKeyDictionary()

# The attribute TensorFlow keeps a branch or body graph in once the op is made.
_KEPT = {"If": "_true_graph", "StatelessIf": "_true_graph", "While": "_body_graph", "StatelessWhile": "_body_graph"}


def _note_later_gradient(op: Any) -> None:
    """A gradient of ``op`` (a cond, case or loop) is being built: one built
    after the op was made (it keeps its graphs), of an op an accumulator
    differentiated as it was made, notes which ops read its added outputs
    until now (``_MadeFrom.read_by_the_jvp``)."""
    noted = _made_from_original.get(op) if op is not None else None
    if noted is None or noted.outputs is None or noted.read_by_the_jvp is not None:
        return
    if getattr(op, _KEPT.get(op.type, "_branch_graph_0"), None) is None:
        return  # the accumulator's own, as the op is made
    noted.read_by_the_jvp = {id(c) for t in op.outputs[noted.outputs :] for c in t.consumers()}


def refuse_lacking(tensors: Any, asked: str) -> None:
    """``asked`` (``"jvp"``: ``ForwardAccumulator.jvp``; else a tape's
    gradient) of ``tensors`` in a graph: refused if they are computed from an
    output that a cond, case or loop made under an accumulator got after the
    recorders recorded it (``_MadeFrom.outputs``).

    Only a gradient of the op reads those outputs. Forward over reverse (the
    jvp of a reverse gradient through the op: a Hessian-vector product) would
    miss their tangents, reverse over forward (a tape's gradient of a jvp,
    whose own gradient of the op reads them) their cotangents: silently wrong
    or None (plain TensorFlow fails). What is computed from the op's first
    outputs is right: its jvp, and a reverse gradient through it."""
    if not _made_from_original:
        return
    by_graph: Dict[Any, List[Any]] = {}
    for t in nest.flatten(tensors):
        if hasattr(t, "op") and hasattr(t, "graph"):
            by_graph.setdefault(t.graph, []).append(t)
    for graph, flat in by_graph.items():
        # The ops an accumulator differentiated as they were made, in this graph.
        noted = [(op, n) for op, n in list(_made_from_original.items()) if op.graph is graph and n.outputs is not None]
        if asked == "jvp":
            # What the readers a later gradient made compute: the jvp's own
            # gradient reads them too, for tangents that are complete.
            added = {
                id(out)
                for op, n in noted
                if n.read_by_the_jvp is not None
                for t in op.outputs[n.outputs :]
                for reader in t.consumers()
                if id(reader) not in n.read_by_the_jvp
                for out in reader.outputs
            }
        else:
            added = {id(t) for op, n in noted for t in op.outputs[n.outputs :]}
        if not added or not _graph_gradients._reaches(flat, added):
            continue
        if asked == "jvp":
            what = (
                "ForwardAccumulator.jvp of a value computed from a reverse gradient through a compiled "
                "tf.cond, case or graph loop that the accumulator differentiated (forward over reverse, "
                "as for a Hessian-vector product): TensorFlow's forward mode has no tangent for the "
                "intermediates that gradient reads, so the jvp would miss their part."
            )
        elif any(r.forward for r in _recorders.recording_now()):
            # The gradient is taken while an accumulator records: the jvp asked
            # later is of this gradient (a hypergradient through optimizer
            # steps in forward mode is such a program).
            what = (
                "A tape's gradient taken while a ForwardAccumulator records, through a compiled tf.cond, "
                "case or graph loop the accumulator differentiated (forward over reverse: the jvp of "
                "this gradient, as through Keras SGD(gradient_accumulation_steps=...) or "
                "LossScaleOptimizer steps): TensorFlow's forward mode has no tangent for the "
                "intermediates that gradient reads, so the jvp would miss their part."
            )
            raise ControlFlowWriteError(f"{what} {_FORWARD_OVER_REVERSE_INSTEAD}")
        else:
            what = (
                "A tape's gradient of a value computed from a ForwardAccumulator's tangents through a "
                "compiled tf.cond, case or graph loop (reverse over forward): TensorFlow's forward mode "
                "made the op output intermediates after the tape recorded it, so the gradient would "
                "miss their part."
            )
        raise ControlFlowWriteError(f"{what} {_SECOND_ORDER_INSTEAD}")


# What to do instead of a second derivative through a compiled cond, case or loop.
_SECOND_ORDER_INSTEAD = (
    "Branch or loop in Python (unrolled while tracing, it is right), run the function eagerly, or take "
    "the second derivative in reverse mode (a tape around the gradient's tape)."
)

# What to do instead of a jvp of a gradient taken under the accumulator.
_FORWARD_OVER_REVERSE_INSTEAD = (
    "Take the derivative in reverse mode instead (a persistent AssignAwareTape around the steps, "
    "its gradient with respect to what the accumulator's tangents are for), branch or loop in "
    "Python (unrolled while tracing, it is right), or run the function eagerly."
)


# What TensorFlow's forward mode raises, while tracing, through a graph loop
# that writes a variable, or through the gradient of a cond (the optionals
# that hold a branch's intermediates: it makes ones like them, for any dtype)
# or through the ops pfor makes of one (attributes that name functions), or
# an eager accumulator's through a cond recorded bare in the function it
# traces (README, Known limits).
_FORWARD_MODE_FAILURES = (
    "without handle data",
    "<dtype: 'variant'> is not compatible",
    "Could not generate a generic TraceType",
    "Tensor.graph is undefined when eager execution is enabled",
)


def forward_mode_failures(error: BaseException) -> List[str]:
    """The texts by which ``error`` is one of TensorFlow's own forward-mode
    failures (``_FORWARD_MODE_FAILURES``), if it is one."""
    return [text for text in _FORWARD_MODE_FAILURES if text in str(error)]


@contextlib.contextmanager
def refusing_forward_mode_failures(what: str, remedy: str) -> Iterator[None]:
    """``what`` (building an op, or a reverse gradient whose ops the
    accumulator differentiates too) while an accumulator records: where
    TensorFlow's forward mode fails on it (plain TensorFlow too), a
    ``ControlFlowWriteError`` saying what to do instead (``remedy``)."""
    try:
        yield
    except (TypeError, ValueError) as error:
        found = forward_mode_failures(error)
        if not found or not _accumulating():
            raise
        raise ControlFlowWriteError(
            f"{what} while a ForwardAccumulator records: TensorFlow's forward mode fails on it "
            f"({type(error).__name__}: ...{found[0]}...; plain TensorFlow too), nothing ran. {remedy}"
        ) from error


# What to do instead of a reverse gradient that TensorFlow's forward mode fails on.
REVERSE_INSTEAD = (
    "Take the gradient with the tape's gradient() inside the accumulator (right), or the jvp and this "
    "gradient in separate calls, or branch in Python."
)


_pending: List[List[Any]] = []

# How many loops that carry written variables this thread is building (``_carrying``).
_carrying_now = threading.local()

# The body graphs of the graph loops that carry written variables (``_carrying``).
_writing_bodies: "weakref.WeakSet[Any]" = weakref.WeakSet()


@functools.lru_cache(maxsize=None)
def _params(function: Any) -> Tuple[str, ...]:
    return tuple(params_of(function))
