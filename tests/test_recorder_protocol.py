"""One recorder protocol: every kind of recorder answers "my current version of
v" the same way (``_resuming.latest_version``).

A variable target asked of a tape entered again, before the variable's first
read in it, means the version the tape goes on from (docs/semantics.md, 6b and
6c), or, for a variable written while the tape was closed, a version it did not
see made: no gradient path (rule 7). The expected values are the rewrite's:
the same program on tensors, by hand, in the comments.
"""

from __future__ import annotations

import contextlib

import pytest
import tensorflow as tf
from oracle import modes, run

from assigntape import AssignAwareTape


def _entered_again(kinds, v, x, written_meanwhile):
    """Tapes of ``kinds`` (outermost first; an AssignAwareTape inside them
    writes) enter, v is written, they exit, v may be written with none open,
    and they are entered again: a variable target before v's first read."""
    tapes = [make(persistent=True) for make in kinds]
    with contextlib.ExitStack() as stack:
        for tape in tapes:
            stack.enter_context(tape)
        with AssignAwareTape():
            v.assign(3.0 * x)
    if written_meanwhile:
        v.assign(5.0)
    with contextlib.ExitStack() as stack:
        for tape in tapes:
            stack.enter_context(tape)  # entered again; v not read in it
        return tuple(tape.gradient(v, x) for tape in tapes)


KINDS = {
    "ours": [AssignAwareTape],
    "plain": [tf.GradientTape],
    "both": [tf.GradientTape, AssignAwareTape],  # the plain one outside
}


@modes
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("written_meanwhile", [False, True], ids=["goes_on", "written_meanwhile"])
def test_a_variable_target_before_its_first_read_in_a_tape_entered_again(mode, kind, written_meanwhile):
    x, v = tf.Variable(2.0), tf.Variable(1.0)

    def body():
        grads = _entered_again(KINDS[kind], v, x, written_meanwhile)
        return tuple(tf.constant(-1.0) if g is None else g for g in grads)

    # The rewrite: v1 = 3 x, d v1 / dx = 3; written meanwhile, v2 = 5 (a
    # constant): no gradient path (None, -1 here).
    expected = -1.0 if written_meanwhile else 3.0
    assert [float(g) for g in run(mode, body)] == [expected] * (2 if kind == "both" else 1)


# -- "go on from my versions": one path for every kind of recorder ----------
# (``_resuming.enter_again``; found by the differential harness of issue #38.)


@modes
def test_two_tapes_of_ours_entered_again_each_see_one_write_made_while_closed(mode):
    x, v = tf.Variable(2.0), tf.Variable(1.0)

    def body():
        t1, t2 = AssignAwareTape(persistent=True), AssignAwareTape(persistent=True)
        with t1:
            with t2:
                v.assign(3.0 * x)
        v.assign(5.0)  # both closed
        with t1:
            with t2:
                y = v * x
        # Rule 7: the write made while they were closed is, for each, one
        # write under stop_recording: one version more (start, 3 x, 5).
        counts = [len(t.versions(v)) for t in (t1, t2)]
        assert counts == [3, 3], counts
        # The rewrite: v2 = 5, a constant: y = 5 x, dy/dx = 5; v's start: no path.
        return t1.gradient(y, x), t2.gradient(y, x), t2.gradient(y, v) is None

    g1, g2, none = run(mode, body)
    assert (float(g1), float(g2), bool(none)) == (5.0, 5.0, True)


def test_another_threads_write_to_a_variable_a_plain_tape_entered_again_never_knew():
    # A plain tape entered again notes as seen what it goes on from and what it
    # read, not every variable written while it was closed (as a tape of ours):
    # another thread may write such a variable before its first read here.
    import threading

    x, v, u = tf.Variable(2.0), tf.Variable(1.0), tf.Variable(1.0)
    plain = tf.GradientTape(persistent=True)
    with plain:
        with AssignAwareTape():
            v.assign(3.0 * x)
    u.assign(4.0)  # closed; the plain tape never read u
    errors = []

    def write():
        try:
            u.assign(7.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with plain:
        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
        y = u * x
    assert errors == []
    # The rewrite: u = 7 when read here: y = 7 x, dy/dx = 7.
    assert float(plain.gradient(y, x)) == 7.0


_MADE_BEFORE_ANY_TAPE = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
u = tf.Variable(1.0)  # made before any tape: its handle names no variable
from assigntape import AssignAwareTape
x, v = tf.Variable(2.0), tf.Variable(1.0)
plain = tf.GradientTape(persistent=True)
with plain:
    a = u * x
    with AssignAwareTape():
        v.assign(3.0 * x)
u.assign(4.0)  # while the plain tape is closed
with plain:
    y = u * x
print(plain.gradient(y, u) is None, float(plain.gradient(y, x)), float(plain.gradient(a, u)))
"""


def test_a_plain_tape_entered_again_cuts_a_variable_made_before_any_tape():
    # A variable made before any tape (its handle unidentifiable) written while
    # the plain tape was closed is a write under stop_recording for it, as for
    # a tape of ours. The rewrite: u at its entry (1) was overwritten by 4, a
    # constant: dy/du None, dy/dx = 4; da/du = x = 2.
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _MADE_BEFORE_ANY_TAPE], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "4.0", "2.0"]


@modes
def test_a_version_named_before_the_first_read_is_the_one_read(mode):
    x, v = tf.Variable(2.0), tf.Variable(1.0)

    def body():
        tape = AssignAwareTape(persistent=True)
        with tape:
            v.assign(3.0 * x)
        v.assign(5.0)  # closed
        with tape:
            last = tape.versions(v)[-1]  # named before v's first read here
            y = v * x
        # The rewrite: y = v2 * x with v2 = 5 the version read: dy/dv2 = x = 2.
        return tape.gradient(y, [last, x])

    assert [float(g) for g in run(mode, body)] == [2.0, 5.0]


@modes
@pytest.mark.parametrize("named_first", [False, True], ids=["read_first", "versions_named_first"])
def test_a_tape_entered_again_beside_one_that_goes_on_from_the_write_it_missed(mode, named_first):
    x, v = tf.Variable(2.0), tf.Variable(1.0)

    def body():
        t1, t2 = AssignAwareTape(persistent=True), AssignAwareTape(persistent=True)
        with t1:
            v.assign(3.0 * x)
        with t2:
            v.assign(4.0 * x)  # t1 closed: for it, a write under stop_recording
        with t1:
            if named_first:
                t1.versions(v)  # before v's first read here
            with t2:  # t2 goes on from its version, 4 x
                y = v * v
        # Rule 7: one write made while t1 was closed, one version more for it
        # (start, 3 x, 4 x), and its latest is the version read.
        assert len(t1.versions(v)) == 3, t1.history()
        # The rewrite: y = v2 * v2 with v2 = 4 x: for t2 dy/dx = 2 v2 * 4 = 64;
        # for t1 v2 is a constant (None), dy/dv2 = 2 v2 = 16.
        return t2.gradient(y, x), t1.gradient(y, x) is None, t1.gradient(y, t1.versions(v)[-1])

    g2, none, g_last = run(mode, body)
    assert (float(g2), bool(none), float(g_last)) == (64.0, True, 16.0)


@pytest.mark.parametrize("where", ["tf.data map", "tf.function"])
@pytest.mark.parametrize("read", ["eager", "tf.function made after"])
def test_a_cut_write_out_of_sight_after_reentry_is_not_undone_by_the_next_read(where: str, read: str) -> None:
    """A tape exited and entered again goes on lazily from its version of v;
    a write made where no read is served to it (a tf.data map, a tf.function
    called eagerly; untracked_writes='cut') is a new version with no path.
    The next read must see that version, not the one the tape went on from
    (found by the thorough profile: dy/dv0 0.5). The rewrite:
    v1 = v0 (recorded), v2 = stop_gradient(w / 2), y = v2 / 2:
    dy/dv0 = None, dy/dw = None, y = 0.5."""
    v, w = tf.Variable(1.0), tf.Variable(2.0)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    tape = AssignAwareTape(persistent=True, untracked_writes="cut")
    with tape:
        v.assign((tf.identity(v) + tf.identity(v)) * 0.5)
    with tape, pytest.warns(UserWarning, match="no gradient flows"):
        value = tf.identity(w) * 0.5
        if where == "tf.data map":
            for _ in tf.data.Dataset.from_tensors(value).map(lambda x: (v.assign(x), x)[1]).with_options(options):
                pass
        else:
            tf.function(lambda x: v.assign(x))(value)
        y = (tf.function(lambda: tf.convert_to_tensor(v) * 1.0)() if read != "eager" else v * 1.0) * 0.5
    assert float(y) == 0.5
    assert tape.gradient(y, v) is None
    assert tape.gradient(y, w) is None


_MADE_BEFORE_IMPORT_NAMED = """
import tensorflow as tf
x, u = tf.Variable(2.0), tf.Variable(1.0)  # made before the import: unidentifiable
x2, u2 = tf.Variable(2.0), tf.Variable(1.0)
from assigntape import AssignAwareTape
t = AssignAwareTape(persistent=True)
with t:
    u.assign(3.0 * x)
u.assign(5.0 * x)  # while t is closed
with t:  # named before any read of u
    n, last = len(t.versions(u)), t.gradient(t.versions(u)[-1], x)
t2 = AssignAwareTape(persistent=True)
with t2:
    u2.assign(3.0 * x2)
u2.assign(5.0 * x2)
with t2:  # exits without reading u2
    pass
print(n, last is None, len(t2.versions(u2)), t2.gradient(t2.versions(u2)[-1], x2) is None)
"""


def test_a_tape_entered_again_names_the_closed_write_of_a_variable_made_before_import():
    # The rewrite: u0 = 1, u1 = 3x, u2 = stop_gradient(5x) (rule 7): three
    # versions, the last with no path to x (None), whether the tape names them
    # inside before reading u, or after an entry that did not read it.
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _MADE_BEFORE_IMPORT_NAMED], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["3", "True", "3", "True"]
