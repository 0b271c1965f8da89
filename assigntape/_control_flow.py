"""``tf.cond`` and graph loops built with a tape open in the graph around them.

``cond`` wraps ``cond_v2.cond_v2``: each branch is traced as a ``Branch``
(``_branches``) whose writes (``_branch_writes``) make values the cond returns,
and after the cond each written variable gets a new version fed by its output.
``while_loop`` wraps ``while_v2.while_loop``: each variable the body writes is
carried as one more loop variable, the body traced again each time it writes
one it did not carry. TensorFlow's forward mode through them is refused where
it fails or is silently wrong.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List

from assigntape import _branches, _graph_gradients, _recorders, _versions
from assigntape._branch_writes import (
    _branch_version,
    _entering,
    _inherit,
    _leave,
    _NotCarried,
    _open,
    _read_now,
    _retry,
    written_again,
)
from assigntape._control_gradients import (
    REVERSE_INSTEAD,
    _carrying_now,
    _control_op,
    _note_recorders,
    _params,
    _pending,
    _writing_bodies,
    building_cond,
    forward_mode_failures,
    refuse_forward_through_wrapper,
    refusing_forward_mode_failures,
)
from assigntape._errors import AssignTapeError, ControlFlowWriteError
from assigntape._tf import (
    context,
    control_flow_util,
    dtypes,
    gen_resource_variable_ops,
    nest,
    ops,
    pywrap_tfe,
    resource_variable_ops,
    variable_scope,
)
from assigntape._wrapping import bind


def cond(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2.cond_v2`` (``tf.cond``, autograph ``if``) in the graph of a tape.

    Each branch also returns the values of the variables it wrote (``Branch``);
    ``build_cond`` makes both branches return the same set, the other branch
    returning its unchanged value. After the cond, each written variable gets
    a new version whose gradient flows into the cond's output, and from there,
    by the cond's own gradient, into whichever branch ran.
    """
    found = _branches.cond_context()
    if found is None:
        return wrapped(*args, **kwargs)
    scope, parent = found
    arguments = bind(("pred", "true_fn", "false_fn", "name"), args, kwargs)
    branches: List[Any] = []

    def traced(fn: Callable[[], Any]) -> Callable[[], Any]:
        def branch_fn() -> Any:
            branch = _open(scope, parent)
            branches.append(branch)
            try:
                out = _read_now(fn())
            finally:
                _branches.close_branch(branch)
            # The user's outputs keep their structure, whatever it is: they are
            # one item of this pair, and only the pair is taken apart.
            return out, {uid: value for uid, (_, value) in branch.values.items()}

        return branch_fn

    arguments["true_fn"] = traced(arguments["true_fn"])
    arguments["false_fn"] = traced(arguments["false_fn"])
    _pending.append(branches)
    try:
        with _entering():
            out, values = wrapped(**arguments)
        _note_recorders((out, values), [b.graph for b in branches])
        _refuse_xla_forward_mode(_control_op((out, values)), branches)
        refuse_forward_through_wrapper(
            (out, values), [var for b in branches for var, _ in b.values.values()], "tf.cond"
        )
    except (TypeError, ValueError, AssertionError, AttributeError) as error:
        _refuse_forward_mode_failure(error, [var for b in branches for var, _ in b.values.values()], "cond")
        raise
    finally:
        _pending.remove(branches)
    written = {uid: var for b in branches for uid, (var, _) in b.values.items()}
    for uid in sorted(values):
        _leave(scope, parent, written[uid], values[uid], "tf.cond")
    return out


def indexed_case(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2.indexed_case`` (``tf.switch_case``): its op noted for the tapes
    that record it bare (``_note_recorders``). (Writes in its branches are not
    followed, as before.)"""
    arguments = bind(("branch_index", "branch_fns", "name", "lower_using_switch_merge"), args, kwargs)
    graphs: List[Any] = []

    def traced(fn: Callable[[], Any]) -> Callable[[], Any]:
        def branch_fn() -> Any:
            graphs.append(ops.get_default_graph())
            return fn()

        return branch_fn

    arguments["branch_fns"] = [traced(fn) for fn in arguments["branch_fns"]]
    with refusing_forward_mode_failures(
        "Forward mode through a compiled tf.switch_case",
        "Use tf.cond or tf.case (conds), branch in Python, or take the gradient in reverse mode.",
    ):
        out = wrapped(**arguments)
    _note_recorders(out, graphs)
    return out


def build_cond(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2._build_cond``, for a cond ``cond`` traced: give both branches
    the same extra outputs, the union of the variables either one wrote."""
    arguments = bind(_params(wrapped), args, kwargs)
    graphs = {id(arguments["true_graph"]), id(arguments["false_graph"])}
    branches = next((b for b in _pending if {id(x.graph) for x in b} == graphs), None)
    if arguments.get("building_gradient"):
        with (
            refusing_forward_mode_failures(
                "A reverse gradient by tf.gradients (or a tape's jacobian) through a compiled tf.cond or case",
                REVERSE_INSTEAD,
            ),
            building_cond(),
        ):
            return wrapped(*args, **kwargs)
    if branches is None:
        with building_cond():
            return wrapped(*args, **kwargs)
    written = {uid: var for b in branches for uid, (var, _) in b.values.items()}
    for branch in branches:
        graph = branch.graph
        out, values = graph.structured_outputs
        base = graph.outputs[: len(graph.outputs) - len(values)]
        values = dict(values)
        with graph.as_default():
            for uid in written.keys() - values.keys():
                # This branch leaves the variable as it was: its value, read here
                # through the branch's own handle (never one of the graph around).
                var = written[uid]
                values[uid] = gen_resource_variable_ops.read_variable_op(branch.version_of(var), var.dtype)
        graph.structured_outputs = (out, values)
        graph.outputs[:] = base + [values[uid] for uid in sorted(values)]
    true_graph, false_graph = arguments["true_graph"], arguments["false_graph"]
    arguments["true_inputs"] = true_graph.external_captures
    arguments["false_inputs"] = false_graph.external_captures
    with building_cond():
        return wrapped(**arguments)


def while_loop(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``while_v2.while_loop`` (``tf.while_loop``, autograph ``for``/``while`` on
    tensors) in the graph of a tape.

    A version made in a loop body can leave it only as loop state. So every
    variable the body writes is carried: its value is one more loop variable,
    reads in the body get a handle fed by that state, each write's functional
    value becomes the next state, and after the loop the final state makes the
    variable's new version; the loop's own gradient does the rest. Which
    variables the body writes is known only once it is traced, so the body is
    traced again, carrying one more variable, each time it writes one it did
    not carry (as TensorFlow itself may trace a function more than once).
    """
    found = _branches.cond_context()
    if found is None:
        return wrapped(*args, **kwargs)
    scope, parent = found
    arguments = bind(_params(wrapped), args, kwargs)
    token = object()
    carried: List[Any] = []
    while True:
        try:
            with _entering():
                return _carrying(wrapped, arguments, scope, parent, carried, token)
        except BaseException as error:
            request = getattr(_retry, "request", None)
            if request is None or request[0] is not token:
                raise
            _retry.request = None
            # (``_NotCarried``, or an error TensorFlow made of it; an interrupt
            # meanwhile is not a request.)
            if not isinstance(error, (_NotCarried, Exception)) or any(v is request[1] for v in carried):
                raise
            carried.append(request[1])


# Per thread, the loop bodies being traced that carry written variables:
# (the body's graph, the variables, their values handed in as loop state).
_carried_in = threading.local()


def refuse_jvp_in_body(targets: Any, made_in: Any) -> None:
    """``ForwardAccumulator.jvp`` asked inside a compiled loop body that
    writes a variable, of a value computed from that variable's value there:
    that value is loop state, whose tangent (the variable's version's at the
    loop's start, or the last iteration's) TensorFlow does not hand the body
    (it carries it only from the loop's start to its end): the jvp would
    drop it. Refused, naming the variable. (After the loop the jvp is right.) Not for an accumulator made in the body (``made_in``: the graph
    it was made in): for it the loop state has no tangent."""
    stack = getattr(_carried_in, "stack", None)
    if not stack:
        return
    graph = ops.get_default_graph()
    for body_graph, carried, values in reversed(stack):
        if body_graph is not graph:
            continue
        if made_in is graph:
            return
        flat = [t for t in nest.flatten(targets) if getattr(t, "graph", None) is graph]
        for var, value in zip(carried, values):
            if _graph_gradients._reaches(flat, {id(value)}):
                raise ControlFlowWriteError(
                    f"ForwardAccumulator.jvp inside a compiled loop body that writes variable "
                    f"{var.name!r}, of a value computed from it: there the variable's value is loop "
                    "state, whose tangent TensorFlow does not hand the body (the jvp would drop it). "
                    "Take the jvp after the loop, or unroll the loop in Python (range instead of "
                    "tf.range)."
                )
        return


def _refuse_read_tangents(scope: Any, token: Any, carried: List[str]) -> None:
    """A loop body just traced reads a variable it does not write, through
    the variable's handle captured from outside, while a ``ForwardAccumulator``
    has a tangent for that handle: TensorFlow's forward mode through the loop
    does not carry a captured handle's tangent (it fails with "variable
    without handle data", or, beside a carried variable with a tangent, drops
    it: a silently wrong jvp). Refused while tracing, nothing run. (The
    variables the body writes, ``carried``, are written through their own
    handle, captured too: their values carry the tangents.)"""
    request = getattr(_retry, "request", None)
    if request is not None and request[0] is token:
        return  # traced again, carrying a written variable: checked then
    graph = ops.get_default_graph()
    for external, _ in getattr(graph, "captures", ()):
        if external.dtype != dtypes.resource:
            continue
        # The same handle in the graphs around: an accumulator in the function
        # watches the function's capture of the eager handle (its
        # placeholder), and a body nested in a body captures the outer body's.
        seen_as = {id(external): external}
        outer = getattr(graph, "outer_graph", None)
        while outer is not None:
            for outside, inside in getattr(outer, "captures", ()):
                if id(outside) in seen_as or id(inside) in seen_as:
                    seen_as[id(outside)], seen_as[id(inside)] = outside, inside
            outer = getattr(outer, "outer_graph", None)
        # Its own handle, or a version written before the loop, as seen in
        # any of the graphs around (a function pfor traces captures it again).
        var = None
        for handle in seen_as.values():
            var = _versions.variable_of_handle(handle)
            if var is None:
                var = scope.owners.get(id(handle))
            if var is not None:
                break
        if var is not None and var._unique_id in carried:
            continue  # written in the body: its value is carried, its handle written through
        _, tangents = pywrap_tfe.TFE_Py_PackJVPs(list(seen_as.values()))
        if tangents:
            name = repr(var.name) if var is not None else "a variable"
            raise ControlFlowWriteError(
                f"Forward mode through a graph loop that reads variable {name} without writing it, "
                "while a ForwardAccumulator has a tangent for it: TensorFlow does not carry the "
                "tangent of a variable captured by a loop body (the jvp would drop it). Read the "
                "variable once before the loop (x_value = x * 1.0) and use that tensor in the body, "
                f"or unroll the loop in Python{_TRACE_FIRST}."
            )


_TRACE_FIRST = (
    "; with the accumulator outside the tf.function, call the function once before "
    "opening it (traced outside the accumulator, it is differentiated right)"
)

_READING_LOOP = "Forward mode through a compiled graph loop (tf.while_loop, a for over tf.range) with a tape open"
_UNROLL = "Unroll the loop in Python (range instead of tf.range)"
_LOOP_INSTEAD = f"{_UNROLL}{_TRACE_FIRST}, or take the gradient in reverse mode."


def _accumulator_recording() -> bool:
    """Whether a forward accumulator (TensorFlow's or ours) records in this thread."""
    return any(r.forward for r in _recorders.recording_now())


def _refuse_xla_forward_mode(op: Any, branches: List[Any]) -> None:
    """Under XLA, a cond whose inputs carry tangents for an open accumulator
    and whose branches capture a variable's resource: TensorFlow's forward
    mode through it does not compile (XLA's ``InvalidArgumentError``,
    "branch_shape", when the function runs; plain TensorFlow too). Refused
    while tracing instead, naming the variables."""
    if op is None or not control_flow_util.GraphOrParentsInXlaContext(op.graph):
        return
    if not _accumulator_recording():
        return
    _, tangents = pywrap_tfe.TFE_Py_PackJVPs(list(op.inputs))
    if not tangents:
        return
    captured = [t for b in branches for t in b.graph.external_captures if t.dtype == dtypes.resource]
    if not captured:
        return
    names = sorted({repr(var.name) for b in branches for var, _ in b.values.values()}) or ["a variable"]
    raise ControlFlowWriteError(
        f"Forward mode through a tf.cond that reads or writes {', '.join(names)} under jit_compile: "
        "TensorFlow's forward mode through a cond that captures a variable does not compile in XLA "
        "(InvalidArgumentError when the function runs, plain TensorFlow too), nothing ran. Compile "
        "without jit_compile, branch in Python, or take the gradient in reverse mode."
    )


def _failed_assertion(error: Exception) -> List[str]:
    """For an ``AssertionError`` raised in cond_v2 or while_v2 (under XLA, the
    forward mode of a cond beside a reverse tape fails there, plain TensorFlow
    too): where, as the text to name; else nothing."""
    if not isinstance(error, AssertionError):
        return []
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return []
    code = tb.tb_frame.f_code
    module = code.co_filename.rsplit("/", 1)[-1]
    if module not in ("cond_v2.py", "while_v2.py"):
        return []
    return [f"an assertion in {module[:-3]}.{code.co_name}"]


def _refuse_forward_mode_failure(error: Exception, written: List[Any], what: str) -> None:
    """TensorFlow failed to build the loop (or cond) that writes ``written``
    while a ``ForwardAccumulator`` is open here: its own forward mode through
    while_v2 or cond_v2 (alone, on the resource the body writes through;
    beside a reverse tape, in the gradient of the loop or cond, as in plain
    TensorFlow). Nothing has run. Raised as a ``ControlFlowWriteError`` that
    says what to do instead."""
    found = forward_mode_failures(error) or _failed_assertion(error)
    if not found:
        return
    if not _accumulator_recording():
        return
    names = ", ".join(sorted({repr(v.name) for v in written})) or "variables"
    remedy = (
        _UNROLL if what == "graph loop" else "Branch in Python, or use assigntape.ForwardAccumulator alone"
    ) + _TRACE_FIRST
    raise ControlFlowWriteError(
        f"Forward mode through a {what} that writes {names}: TensorFlow's own forward mode "
        f"through it failed while tracing ({type(error).__name__}: ...{found[0]}...), nothing "
        f"ran. {remedy}, or take the gradient in reverse mode."
    ) from error


def _carrying(
    wrapped: Callable[..., Any], arguments: Dict[str, Any], scope: Any, parent: Any, carried: List[Any], token: Any
) -> Any:
    """Builds the loop with ``carried``'s values as extra loop state.

    The loop state is the pair (the user's ``loop_vars``, the carried values):
    TensorFlow hands the body the user's part taken apart exactly as it would
    have without the pair, checks the body's result against it, and packs the
    result back into it, for any structure ``tf.nest`` knows (lists, tuples,
    namedtuples, dicts, attrs classes, nested), with its shape invariants."""
    loop_vars = arguments["loop_vars"]
    user_cond, user_body = arguments["cond"], arguments["body"]
    bodies: List[Any] = []  # the body's graphs (TensorFlow may trace it more than once)
    if not carried:
        # First attempt: carry nothing, but watch the body for writes.
        def watched_body(*state: Any) -> Any:
            bodies.append(ops.get_default_graph())
            body = _open(scope, parent, [], token)
            try:
                out = _read_now(user_body(*state))
                _refuse_read_tangents(scope, token, [])
                return out
            finally:
                _branches.close_branch(body)

        # (A loop that writes nothing: TensorFlow's forward mode through its
        # gradient fails beside a reverse tape, plain TensorFlow too.)
        with refusing_forward_mode_failures(_READING_LOOP, _LOOP_INSTEAD):
            result = wrapped(**dict(arguments, body=watched_body))
        _note_recorders(result, bodies)
        return result
    uids = [v._unique_id for v in carried]
    outer = [_branches.version_in(scope, parent, v) for v in carried]
    start = tuple(gen_resource_variable_ops.read_variable_op(h, v.dtype) for h, v in zip(outer, carried))
    for v in carried:
        resource_variable_ops.variable_accessed(v)  # the start value's gradient goes to v

    def cond_fn(state: Any, values: Any) -> Any:
        return user_cond(*state)

    def body_fn(state: Any, values: Any) -> Any:
        bodies.append(ops.get_default_graph())
        _writing_bodies.add(bodies[-1])
        body = _branches.open_branch(scope, parent, uids, token)
        try:
            for v, value in zip(carried, values):
                # This iteration's value of v is the state it was handed.
                _branch_version(body, v, value, value)
            _inherit(body)
            stack = _carried_in.__dict__.setdefault("stack", [])
            stack.append((ops.get_default_graph(), carried, values))
            try:
                out = _read_now(user_body(*state))
            finally:
                stack.pop()
            _refuse_read_tangents(scope, token, uids)
        finally:
            _branches.close_branch(body)
        if not nest.is_nested(out):
            out = [out]  # as TensorFlow does: a body may return its only variable bare
        return out, tuple(body.values[uid][1] for uid in uids)

    invariants = arguments.get("shape_invariants")
    if invariants is not None:
        invariants = (invariants, tuple(t.shape for t in start))
    _carrying_now.depth = getattr(_carrying_now, "depth", 0) + 1
    try:
        result, final = wrapped(
            **dict(
                arguments,
                cond=cond_fn,
                body=body_fn,
                loop_vars=(loop_vars, start),
                shape_invariants=invariants,
                return_same_structure=True,
            )
        )
    except (TypeError, ValueError, AssertionError) as error:
        _refuse_forward_mode_failure(error, carried, "graph loop")
        raise
    finally:
        _carrying_now.depth -= 1
    _note_recorders((result, final), bodies)
    refuse_forward_through_wrapper((result, final), carried, "graph loop")
    final = written_again(outer, carried, list(final))
    for v, value in zip(carried, final):
        _leave(scope, parent, v, value, "tf.while_loop")
    if arguments.get("return_same_structure", True):
        return result
    # As TensorFlow does without return_same_structure: one tensor comes back bare.
    flat = nest.flatten(result, expand_composites=True)
    return flat[0] if len(flat) == 1 else result


def variable_scope_kept(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``tf.map_fn``, ``tf.scan``, ``tf.foldl`` and ``tf.foldr`` in a graph.

    In a graph these set a caching device on the current variable scope (a
    tf.function's graph shares that scope object with the eager program around
    it) and put it back only when ``fn`` returns. A refusal of ours raised in
    ``fn`` would leave it set for the rest of the process, and every later
    ``tf.distribute`` strategy scope or ``tf.compat.v1.variable_scope`` entered
    eagerly would raise NotImplementedError ("Caching devices is not yet
    supported when eager execution is enabled"). So it is put back when one of
    our errors leaves, or a KeyboardInterrupt (which may land in our code,
    most of what runs there while a tape is open); any other error is left to
    TensorFlow, as without us.
    """
    if context.executing_eagerly():  # (as they do: eagerly nothing is set)
        return wrapped(*args, **kwargs)
    scope = variable_scope.get_variable_scope()
    device = scope.caching_device
    try:
        return wrapped(*args, **kwargs)
    except (AssignTapeError, KeyboardInterrupt):
        scope.set_caching_device(device)
        raise
