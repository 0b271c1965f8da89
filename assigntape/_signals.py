"""Signal handlers that never raise inside code TensorFlow's C++ calls.

Python runs a signal's handler at the next bytecode boundary of the main
thread, wherever that is (SIGINT's default handler raises
``KeyboardInterrupt`` there). That may be inside the ``_handle`` descriptor,
which TensorFlow's C++ fast path calls to read a variable and which must not
raise: C++ does not expect an error there, and the process dies with SIGSEGV.
The descriptor defers its own errors, but a handler's exception can land at
its very first instruction, before any ``try`` of its own.

So, while the patches are installed, every Python-level signal handler runs
through ``Guarded``: when the signal arrives with such code on the stack, the
handler does not run there; the signal is sent again from another thread, and
its handler runs once the main thread has left that code. ``signal.signal`` and ``signal.getsignal`` are patched so
that handlers set later are guarded too and the caller sees its own handler.
Handlers can be set only from the main thread: installed from another thread,
the handlers already set stay unguarded until the next install there.
"""

from __future__ import annotations

import _thread
import signal
import threading
from types import CodeType, FrameType
from typing import Any, Callable, Dict, Optional, Set

__all__ = ["Guarded", "called_from_c", "getsignal", "guard_all", "setsignal", "unguard_all"]

# The code objects TensorFlow's C++ may call and that must not raise.
_CALLED_FROM_C: Set[CodeType] = set()


def called_from_c(code: CodeType) -> None:
    """Registers ``code`` as code TensorFlow's C++ calls (no handler raises in it)."""
    _CALLED_FROM_C.add(code)


def _inside_c_callback(frame: Optional[FrameType]) -> bool:
    while frame is not None:
        if frame.f_code in _CALLED_FROM_C:
            return True
        frame = frame.f_back
    return False


class Guarded:
    """A Python-level signal handler, run only outside code C++ calls."""

    __slots__ = ("handler",)

    def __init__(self, handler: Callable[[int, Optional[FrameType]], Any]) -> None:
        self.handler = handler

    def __call__(self, signum: int, frame: Optional[FrameType]) -> Any:
        if _inside_c_callback(frame):
            _again_later(signum)
            return None
        return self.handler(signum, frame)

    def __repr__(self) -> str:
        return f"Guarded({self.handler!r})"


def _again_later(signum: int) -> None:
    """Sends ``signum`` to the main thread again, from another thread: by the
    time it arrives the main thread has left the code C++ called (else this
    happens once more). Raised from here, it would run its handler at once,
    still inside that code."""

    def send() -> None:
        main = threading.main_thread().ident
        try:
            if main is not None:
                signal.pthread_kill(main, signum)
        except (AttributeError, OSError, ValueError):  # no pthread_kill (Windows): as a SIGINT
            _thread.interrupt_main()

    _thread.start_new_thread(send, ())


def _unguarded(handler: Any) -> Any:
    return handler.handler if isinstance(handler, Guarded) else handler


def _guardable(handler: Any) -> bool:
    return callable(handler) and not isinstance(handler, (Guarded, int))


def setsignal(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``signal.signal``: a Python-level handler is guarded; the previous
    handler is returned as its caller set it."""
    args = list(args)
    if len(args) >= 2 and _guardable(args[1]):
        args[1] = Guarded(args[1])
    elif "handler" in kwargs and _guardable(kwargs["handler"]):
        kwargs = dict(kwargs, handler=Guarded(kwargs["handler"]))
    return _unguarded(wrapped(*args, **kwargs))


def getsignal(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``signal.getsignal``: the handler as its caller set it."""
    return _unguarded(wrapped(*args, **kwargs))


# The functions of the signal module itself, unpatched (the patches may be on).
_SIGNAL: Callable[..., Any] = signal.signal
_GETSIGNAL: Callable[..., Any] = signal.getsignal


def _each_handler() -> Dict[int, Any]:
    found: Dict[int, Any] = {}
    for signum in signal.valid_signals():
        try:
            found[int(signum)] = _GETSIGNAL(signum)
        except (ValueError, OSError):  # not a signal this platform lets Python see
            continue
    return found


def guard_all() -> None:
    """Guards every Python-level handler set now (from the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in _each_handler().items():
        if _guardable(handler):
            try:
                _SIGNAL(signum, Guarded(handler))
            except (ValueError, OSError, RuntimeError):
                continue


def unguard_all() -> None:
    """Puts back every guarded handler as its caller set it (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in _each_handler().items():
        if isinstance(handler, Guarded):
            try:
                _SIGNAL(signum, handler.handler)
            except (ValueError, OSError, RuntimeError):
                continue
