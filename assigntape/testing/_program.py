"""``Program``: one random program, checked against its functional rewrite."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, List, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

__all__ = ["Program", "compare", "tolerances", "assert_close", "assert_gradients_close"]


@dataclasses.dataclass(frozen=True)
class Program:
    """A straight-line program of reads, writes and ops over variables.

    Its ``repr`` is Python source that rebuilds it (``from
    assigntape.testing.strategies import Program`` first), so a failing
    example hypothesis prints can be pasted into a test: ``Program(...).check()``.
    The statements are described in ``assigntape.testing._vocabulary``.

    Attributes:
      shapes: each variable's shape.
      dtypes: each variable's dtype name (``"float32"``, ``"float64"``,
        ``"complex128"``); ``tf.DType``s are accepted and stored as names.
      n_params: how many float64 parameter tensors (watched) the program uses.
      statements: the program.
      seed: the seed of the variables' and parameters' start values.
      keras: which variables are Keras 3 variables (empty: none).
    """

    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[str, ...]
    n_params: int
    statements: Tuple[Tuple[Any, ...], ...]
    seed: int
    keras: Tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        # Names, not tf.DType objects: the repr must be plain Python literals.
        object.__setattr__(self, "dtypes", tuple(tf.as_dtype(d).name for d in self.dtypes))
        object.__setattr__(self, "shapes", tuple(tuple(int(n) for n in s) for s in self.shapes))
        if len(self.dtypes) != len(self.shapes) or (self.keras and len(self.keras) != len(self.shapes)):
            raise ValueError("shapes, dtypes and keras must have one entry per variable")

    @property
    def tf_dtypes(self) -> Tuple[Any, ...]:
        return tuple(tf.as_dtype(d) for d in self.dtypes)

    def initial_values(self) -> Tuple[List[np.ndarray], List[float]]:
        """The variables' and parameters' start values (from ``seed``)."""
        rng = np.random.default_rng(self.seed)
        vars0 = []
        for s, d in zip(self.shapes, self.tf_dtypes):
            value = rng.uniform(-1, 1, size=s)
            if d.is_complex:
                value = value + 1j * rng.uniform(-1, 1, size=s)
            vars0.append(value)
        params0 = [rng.uniform(-1, 1) for _ in range(self.n_params)]
        return vars0, params0

    def is_keras(self, i: int) -> bool:
        return bool(self.keras) and self.keras[i]

    def kinds(self) -> Tuple[str, ...]:
        """The kinds of statement in the program."""
        return tuple(stmt[0] for stmt in self.statements)

    @property
    def exact(self) -> bool:
        """Whether the program computes its mathematical function: no write
        under ``stop_recording`` or cut (those deliberately drop a path)."""
        return not any(k in ("write_stopped", "fn_write") for k in self.kinds())

    def with_events_closed(self) -> "Program":
        """The program, with the tape entered again at the end if a pause left
        it exited (the loss is computed on the tape)."""
        paused = False
        for stmt in self.statements:
            if stmt[0] == "event" and stmt[1] in ("pause", "resume"):
                paused = stmt[1] == "pause"
        if not paused:
            return self
        return dataclasses.replace(self, statements=self.statements + (("event", "resume", False),))

    def check(self, compiled: Union[bool, str] = False) -> None:
        """Runs the program under ``AssignAwareTape`` and its functional rewrite
        under ``tf.GradientTape``, and compares them.

        Args:
          compiled: ``False`` runs the tape eagerly, ``True`` inside a
            ``tf.function``, ``"xla"`` inside ``tf.function(jit_compile=True)``.
            Programs with tape events or writes inside ``tf.function``s
            called from the eager tape run eagerly only; those whose
            ``tf.function``s are called in the tape's function, compiled only.

        Raises:
          AssertionError: the loss, a variable's final value or a gradient
            differs, or one side has a ``None`` gradient where the other has one.
          ValueError: ``compiled`` does not suit the program.
        """
        compare(self, compiled)


def tolerances(program: Program) -> Tuple[float, float]:
    """(rtol, atol) for comparing two orders of the same arithmetic."""
    return (2e-4, 2e-5) if "float32" in program.dtypes else (1e-9, 1e-11)


def _numpy(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    return np.asarray(x)


def assert_close(got: Any, expected: Any, rtol: float, atol: float, what: str) -> None:
    """Values (a tensor or a list of them) equal within tolerances; NaN and
    infinities only where the expected value has them."""
    got_flat, expected_flat = tf.nest.flatten(got), tf.nest.flatten(expected)
    assert len(got_flat) == len(expected_flat), f"{what}: {len(got_flat)} values, expected {len(expected_flat)}"
    for i, (a, e) in enumerate(zip(got_flat, expected_flat)):
        np.testing.assert_allclose(_numpy(a), _numpy(e), rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{what} [{i}]")


def assert_gradients_close(got: Any, expected: Any, rtol: float, atol: float, what: str) -> None:
    """Gradient structures equal leaf by leaf, ``None`` exactly where expected."""
    tf.nest.assert_same_structure(got, expected)
    paths = _paths(expected)
    for path, a, e in zip(paths, tf.nest.flatten(got), tf.nest.flatten(expected)):
        if e is None:
            assert a is None, f"{what} by {path}: expected None, got {_numpy(a)}"
            continue
        assert a is not None, f"{what} by {path}: expected {_numpy(e)}, got None"
        np.testing.assert_allclose(
            _numpy(a), _numpy(e), rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{what} by {path}"
        )


def _paths(structure: Any) -> Sequence[str]:
    """A readable name for each leaf: ``vars[1]``, ``params[0]``."""
    if isinstance(structure, dict):
        return [f"{k}{p}" for k in sorted(structure) for p in _paths_in(structure[k])]
    return [f"[{i}]" for i in range(len(tf.nest.flatten(structure)))]


def _paths_in(value: Any) -> Sequence[str]:
    if isinstance(value, (list, tuple)):
        return [f"[{i}]" for i in range(len(value))]
    return [""]


def compare(program: Program, compiled: Union[bool, str] = False) -> Tuple[Any, Any]:
    """``Program.check``; returns the tape's loss and gradients (the outer
    tape's, for a program with events), for further checks."""
    from assigntape.testing import _interpreter as run

    if compiled not in (False, True, "xla"):
        raise ValueError(f"compiled must be False, True or 'xla', got {compiled!r}")
    kinds = program.kinds()
    if compiled and ("event" in kinds or "fn_write" in kinds):
        raise ValueError("programs with tape events or cut writes in tf.functions run eagerly only")
    if not compiled and "fn_write_inline" in kinds:
        raise ValueError("programs with writes in tf.functions called in the tape's function run compiled only")
    rtol, atol = tolerances(program)
    # A program that writes inside tf.functions runs on tapes that cut those writes.
    untracked = "cut" if "fn_write" in kinds else "raise"
    if "event" in kinds:
        program = program.with_events_closed()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the cut writes' warnings
            loss, grads, inner, finals = run.events_tape_run(program, untracked)
        e_loss, e_grads, e_inner, e_finals = run.events_rewrite_run(program)
        assert (inner is None) == (e_inner is None), "inner tape: gradients on one side only"
        if inner is not None:
            assert_gradients_close(inner, e_inner, rtol, atol, "inner tape's gradient")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the cut writes' warnings
            loss, grads, finals = run.tape_run(program, bool(compiled), compiled == "xla", untracked)
        e_loss, e_grads, e_finals = run.rewrite_run(program)
    assert_close(loss, e_loss, rtol, atol, "loss")
    assert_close(finals, e_finals, rtol, atol, "final values")
    assert_gradients_close(grads, e_grads, rtol, atol, "gradient")
    return loss, grads
