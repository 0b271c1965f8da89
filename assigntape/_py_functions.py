"""``tf.py_function`` / ``tf.numpy_function`` in a graph.

Eagerly, the Python body runs there and then, in the tape's thread, and its
writes are followed like any other. Traced in a graph (a ``tf.function``, a
``tf.data`` function such as ``from_generator``'s or a ``map``'s, traced
before or under a tape), the body runs only when the graph runs, in one of
TensorFlow's threads: the tape cannot follow a write made there, and reads
after it would credit the version from before (or, for a variable the tape
had not read yet, the write would pass for another thread's and lose its
path). What the body will write is unknown while tracing, so the body is run
under a probing tape whenever a tape of ours is open (in the tape's own
graph, at every run), and a write of a differentiable variable there fails
the graph's run with ``UntrackedWriteError`` (TensorFlow reports it as its
own ``UnknownError``, the message included; the write has happened by then).
Always on: a dataset's functions are traced where it is made, often before
the first tape.
"""

from __future__ import annotations

import functools
import sys
import weakref
from types import FrameType
from typing import Any, Callable, Optional

from assigntape import _branches, _functions, _registry
from assigntape._errors import UntrackedWriteError
from assigntape._tf import executing_eagerly, nest, ops
from assigntape._wrapping import bind

__all__ = ["py_function", "refusal_in"]

_PARAMS = ("func", "inp", "Tout", "stateful", "use_eager_py_func", "is_grad_func", "name")

# The tape class the probe opens (``AssignAwareTape``), set by ``_tape`` as it
# is imported: the tape needs the patches, which need this module, so this
# module cannot import the tape.
probe_tape: Any = None


def py_function(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``script_ops._internal_py_func``, which every py_function, numpy_function
    and py_func builds through."""
    if executing_eagerly():
        return wrapped(*args, **kwargs)  # the body runs here, followed
    arguments = bind(_PARAMS, args, kwargs)
    # Traced in a tape's own graph, the graph only ever runs for that tape:
    # probe every run. Traced for an eager tape's call, the function may run
    # later with no tape about: probe only while it runs for a thread with a
    # tape open (``_functions.running_under_tape``), not for another thread's;
    # a tf.data function's, run by tf.data's threads, while any tape is open.
    found = _branches.call_context()
    always = _Always(found is not None and found[0].key is not None, _in_data_function())
    arguments["func"] = _probed(arguments["func"], always, ops.get_default_graph())
    result = wrapped(**arguments)
    try:
        _always[nest.flatten(result)[0].op.get_attr("token")] = always
    except (AttributeError, IndexError, TypeError, ValueError):
        pass  # no op to name it by: probed while a tape is open only
    return result


class _Always:
    """Whether a body wrapped here is probed at every run (or only while a
    tape is open), held by the body."""

    def __init__(self, on: bool, data: bool) -> None:
        self.on = on
        # A tf.data function's: tf.data's threads run it for an iterator, with
        # no call to tell which thread it runs for: probed while any tape is open.
        self.data = data


def _in_data_function() -> bool:
    """Whether the py_function is being made for a ``tf.data`` function
    (tf.data's ``StructuredFunctionWrapper`` traces it, or, in tf.data's debug
    mode, makes the function itself a py_function: its frames are on the stack)."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith("structured_function.py"):
            return True
        frame = frame.f_back
    return False


# By their op's token, the bodies' ``_Always`` while they live. A dataset made
# outside a tape's graph and pulled there holds bodies traced with no tape
# about: from then on they run for that graph, where no tape is open when it
# runs (``probe_always``).
_always: "weakref.WeakValueDictionary[Any, _Always]" = weakref.WeakValueDictionary()


def probe_always(graph: Any) -> None:
    """The bodies of the py_functions in ``graph`` (a dataset's function's,
    pulled in a tape's graph) are probed at every run from now on."""
    for op in graph.get_operations():
        if op.type in _PY_FUNC_OPS:
            always = _always.get(op.get_attr("token"))
            if always is not None:
                always.on = True


_PY_FUNC_OPS = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})


def _probed(func: Callable[..., Any], always: _Always, graph: Any) -> Callable[..., Any]:
    name = getattr(func, "__name__", repr(func))

    @functools.wraps(func)
    def run(*args: Any) -> Any:
        if not always.on and not (_functions.running_under_tape(graph) or (always.data and _registry.any_scopes())):
            return func(*args)  # not run for a tape of ours now: plain TensorFlow
        try:
            with probe_tape(persistent=True, watch_accessed_variables=False) as probe:
                result = func(*args)
        except UntrackedWriteError as error:
            # The other-thread rule saw it first (the body runs in one of
            # TensorFlow's threads): say where the write really comes from.
            raise UntrackedWriteError(f"{_refusal(name, 'a variable')} ({error})") from None
        written = sorted(probe.history().variables)
        # A closed persistent tape holds the patches while it lives, and the
        # error's traceback (which TensorFlow may keep) holds this frame.
        del probe
        if written:
            raise UntrackedWriteError(_refusal(name, f"variable(s) {', '.join(written)}"))
        return result

    return run


def _refusal(name: str, what: str) -> str:
    return (
        f"The Python function {name!r} of a tf.py_function / tf.numpy_function (or a "
        f"Dataset.from_generator generator) wrote {what} while an AssignAwareTape was open: "
        "traced in a graph (a tf.function's or a tf.data function's), the body runs when "
        "TensorFlow's runtime runs that graph, out of the tape's sight, so reads after it "
        "would credit the previous version, a silently wrong gradient. Make the write in the "
        "tape's own code, outside the py_function and the dataset's functions, or run the step "
        "eagerly (tf.config.run_functions_eagerly(True)), where a py_function's writes are followed."
    )


_MARK = UntrackedWriteError.__name__ + ": "


def refusal_in(error: Exception) -> Optional[UntrackedWriteError]:
    """The refusal a probed body raised, which TensorFlow's runtime reported
    as its own error (an ``UnknownError`` carrying our message), if ``error``
    is one: raised again as itself, the error the tape's rules promise."""
    text = str(error)
    start = text.find(_MARK)
    if start < 0:
        return None
    refusal: UntrackedWriteError = UntrackedWriteError(text[start + len(_MARK) :].split("\n", 1)[0])
    return refusal
