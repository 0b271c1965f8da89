"""Tools to check code that differentiates through variable writes.

* ``numerical_gradient(fn, sources)``: central finite differences of a
  function that may write variables, restoring them between runs.
* ``check_gradients(fn, sources)``: the ``AssignAwareTape`` gradients of
  ``fn`` against those differences; ``AssertionError`` with a table on a
  mismatch.
* ``assigntape.testing.strategies.programs()``: a hypothesis strategy of random
  programs with writes, each checked against its functional rewrite by
  ``.check()`` (needs ``hypothesis``: ``pip install "assigntape[testing]"``).
* ``pytest -p assigntape.testing.swap_tape``: runs a test suite with
  ``tf.GradientTape`` replaced by ``AssignAwareTape``.

Importing this package does not import hypothesis or pytest.
"""

from assigntape.testing._checking import check_gradients
from assigntape.testing._numerical import numerical_gradient

__all__ = ["check_gradients", "numerical_gradient"]
