"""What a plain ``tf.GradientTape`` or TensorFlow's ``ForwardAccumulator``
followed beside an ``AssignAwareTape`` is asked: ``gradient``, ``jacobian``,
``watched_variables`` and ``jvp``, with variables named the way
``AssignAwareTape`` names them, from the notes ``_plain_tapes`` keeps on it
at entry and exit:

* a variable source means the version current when the plain tape was entered;
* a variable target means the version current when it was exited (the latest
  one while it is still open).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from assigntape import (
    _branches,
    _control_flow,
    _control_gradients,
    _plain_tapes,
    _registry,
    _resolve,
    _resuming,
    _serving,
    _versions,
)
from assigntape._tf import (
    UnconnectedGradients,
    array_ops,
    executing_eagerly,
    gen_resource_variable_ops,
    nest,
)
from assigntape._wrapping import bind, binds

__all__ = [
    "accumulator_jvp",
    "gradient",
    "jacobian",
    "ours",
    "tensorflows_gradient",
    "unfollowed",
    "watched_variables",
]

# The notes ``_plain_tapes`` keeps on a followed recorder.
_START = _plain_tapes._START
_END = _plain_tapes._END
_LATEST = _plain_tapes._LATEST
_HELD = _plain_tapes._HELD
_MADE_IN = _plain_tapes._MADE_IN
_REBASED = _plain_tapes._REBASED
_is_plain = _plain_tapes._is_plain
_open_plain = _registry.open_plain
_all_scopes = _registry._all_scopes


def _still_open(instance: Any) -> bool:
    """Entered and not exited: recording, or paused (``stop_recording``), in
    which case a variable target still means its latest version."""
    return bool(getattr(instance, "_recording", False)) or any(ref() is instance for ref, _ in _open_plain())


def _map(x: Any, versions: Optional[Dict[str, Any]], open_now: bool, recorder: Any = None) -> Any:
    var = _resolve.gradient_variable(x)
    if var is None:
        return x
    if open_now:
        found = _branches.call_context()
        if found is not None:
            scope, branch = found
            if branch is None and recorder is not None and var._unique_id not in scope.current:
                # Entered again, not read since: what it goes on from.
                return _resuming.latest_version(scope, var, recorder, _versions.canonical_handle(var))
            return _branches.version_in(scope, branch, var)
    handle = versions.get(var._unique_id) if versions else None
    return _versions.canonical_handle(var) if handle is None else handle


def _end(instance: Any) -> Optional[Dict[str, Any]]:
    """The versions a variable target means, once no tape of ours is open."""
    notes = instance.__dict__  # (where setattr put them: no caught AttributeError when missing)
    end: Optional[Dict[str, Any]] = notes.get(_END)
    return notes.get(_LATEST) if end is None else end


def tensorflows_gradient(cls: type, after: type) -> Callable[..., Any]:
    """The ``gradient`` that ``super(after, tape)`` finds for a tape of class
    ``cls``, to call as a function: a subclass's own in between (a mixin's)
    if any, else TensorFlow's own function, without the follower (``gradient``
    below) the class attribute is, which does nothing for a tape of ours.

    Calling past it saves a Python frame under the whole backward pass, and
    that is measurable: TensorFlow keeps every eager op's Python stack (up to
    30 frames), about 35 ns a frame an op.
    """
    mro = cls.__mro__
    method: Any = None
    for klass in mro[mro.index(after) + 1 :]:
        method = vars(klass).get("gradient")
        if method is not None:
            break
    if getattr(method, "_self_wrapper", None) is gradient:  # (wrapt's name for the wrapper function)
        method = method.__wrapped__
    found: Callable[..., Any] = method
    return found


def ours(instance: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``instance`` is a tape of ours, which ``enter`` and ``exit``
    leave alone (its own methods do the work)."""
    return not _is_plain(instance)


_GRADIENT_PARAMS = ("target", "sources", "output_gradients", "unconnected_gradients")


def unfollowed(instance: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``gradient`` can be TensorFlow's, called at once: it asks
    TensorFlow (``_asks_tensorflow``), and the tape keeps no record of the
    writes made while it is closed, which ``gradient`` lets go after a
    non-persistent tape's one gradient."""
    return _HELD not in instance.__dict__ and _asks_tensorflow(instance, args, kwargs)


def _asks_tensorflow(instance: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``gradient`` is TensorFlow's for this tape and question: the tape
    is one of ours (which maps its own question), or a plain tape never beside
    one of ours, or one opened with no version about and none made since,
    asked a question with nothing to map (``_resolve.plain_question``): each
    variable source means its own handle, which TensorFlow takes from it."""
    if not _is_plain(instance):
        return True
    notes = instance.__dict__
    start = notes.get(_START)
    if not _all_scopes and start is None and notes.get(_END) is None and notes.get(_LATEST) is None:
        # (No _end(instance): a call fewer.) This follower is switched with the
        # dormant patches: when none has been needed for a while, TensorFlow's
        # own method goes back in its place (``_registry.idle``).
        if _registry._switched:
            _registry.idle()
        return True
    if start or _REBASED in notes:
        return False
    arguments = bind(_GRADIENT_PARAMS, args, kwargs)
    return (
        _resolve.plain_question(
            arguments.get("target"),
            arguments.get("sources"),
            arguments.get("unconnected_gradients", UnconnectedGradients.NONE),
        )
        and _serving.serves_own_handles()
    )


def gradient(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``GradientTape.gradient`` of a plain tape: variables named as above."""
    _control_gradients.refuse_lacking(args[0] if args else kwargs.get("target"), "gradient")
    if _asks_tensorflow(instance, args, kwargs) or not binds(_GRADIENT_PARAMS, 2, args, kwargs):
        grads = wrapped(*args, **kwargs)
    else:
        grads = _mapped_gradient(wrapped, instance, args, kwargs)
    notes = instance.__dict__
    if _HELD in notes and instance._tape is None:
        # A non-persistent tape's recording went with its gradient: entered
        # again, it records anew, from nothing. Its record of the writes made
        # while it is closed goes now, not when the tape is garbage: until
        # then every dormant patch would take its slow path (a Keras train
        # step inside a tape of ours exits its tape, asks it, then writes).
        _resuming.closed_tapes.discard(notes.pop(_HELD)[2])
    return grads


def _mapped_gradient(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    arguments = bind(_GRADIENT_PARAMS, args, kwargs)
    open_now = _still_open(instance)
    start, end = getattr(instance, _START, None), _end(instance)
    sources = arguments["sources"]
    flat = nest.flatten(sources)
    mapped = [_map(s, start, False) for s in flat]
    rebased = instance.__dict__.get(_REBASED)
    if rebased:
        # Their versions at its entry are watched for it; a variable it was
        # never told to watch gets what TensorFlow gives: no gradient.
        watched = {v._unique_id for v in map(_resolve.gradient_variable, instance.watched_variables()) if v is not None}
        for i, s in enumerate(flat):
            var = _resolve.gradient_variable(s)
            if var is not None and var._unique_id in rebased and var._unique_id not in watched:
                mapped[i] = array_ops.identity(mapped[i])  # a tensor nothing depends on
    arguments["sources"] = mapped
    if arguments.get("target") is not None:
        arguments["target"] = nest.map_structure(lambda t: _map(t, end, open_now, instance), arguments["target"])
    zero = arguments.get("unconnected_gradients") in (UnconnectedGradients.ZERO, "zero")
    if zero:
        # TensorFlow cannot build zeros for a raw handle: build them here.
        arguments["unconnected_gradients"] = UnconnectedGradients.NONE
    grads = wrapped(**arguments)
    if zero:
        grads = [_resolve.zeros_like_source(s, m) if g is None else g for g, s, m in zip(grads, flat, mapped)]
    return nest.pack_sequence_as(sources, grads)


def watched_variables(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``GradientTape.watched_variables``: each variable once, in
    TensorFlow's order (``_resolve.watched_in_order``)."""
    found = wrapped(*args, **kwargs)
    listed = _resolve.watched_in_order(found)
    same = len(listed) == len(found) and all(a is b for a, b in zip(listed, found))
    return found if same else listed  # (TensorFlow's own tuple where nothing changed)


def jacobian(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``GradientTape.jacobian`` / ``batch_jacobian`` of a plain tape: a
    variable target means its version named as above. TensorFlow's jacobians
    reshape the target, which would read the variable's own handle: read the
    version here, on the tape."""
    target = args[0] if args else kwargs.get("target")
    var = _resolve.resolve(target) if _is_plain(instance) else None
    if var is None:
        return wrapped(*args, **kwargs)
    handle = _map(var, _end(instance), _still_open(instance), instance)
    with instance._ensure_recording():
        value = gen_resource_variable_ops.read_variable_op(handle, var.dtype)
    if args:
        return wrapped(value, *args[1:], **kwargs)
    return wrapped(**{**kwargs, "target": value})


def accumulator_jvp(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``ForwardAccumulator.jvp``: a variable means its latest version while
    the accumulator was open, also once it is closed (TensorFlow's reads the
    variable's own handle then)."""
    if not executing_eagerly():
        primals = args[0] if args else kwargs.get("primals")
        _control_flow.refuse_jvp_in_body(primals, instance.__dict__.get(_MADE_IN))
        _control_gradients.refuse_lacking(primals, "jvp")
    end = getattr(instance, _END, None)
    params = ("primals", "unconnected_gradients")
    if end is None or getattr(instance, "_recording", False) or not binds(params, 1, args, kwargs):
        return wrapped(*args, **kwargs)
    arguments = bind(params, args, kwargs)
    arguments["primals"] = nest.map_structure(lambda p: _map(p, end, False), arguments["primals"])
    return wrapped(**arguments)
