"""assigntape: a ``tf.GradientTape`` through which gradients flow across variable writes.

>>> import tensorflow as tf
>>> from assigntape import AssignAwareTape
>>> a, b, c = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0)
>>> with AssignAwareTape() as tape:
...     c.assign(a + b)
...     loss = c ** 2
>>> float(tape.gradient(loss, b))
6.0
"""

from assigntape._errors import AssignTapeError, ControlFlowWriteError, NotAVariableError
from assigntape._tape import AssignAwareTape

__version__ = "0.1.0"

__all__ = [
    "AssignAwareTape",
    "AssignTapeError",
    "ControlFlowWriteError",
    "NotAVariableError",
]
