"""MAML and Meta-SGD on sinusoid regression (Finn et al. 2017), on a plain Keras MLP.

Run with ``python -m assigntape.examples.maml_sine`` (``--help`` for options).

Each task is a sine wave ``y = A sin(x - phase)`` with A in [0.1, 5], phase in
[0, pi] and x in [-5, 5]; a learner sees K = 10 points of a new task and adapts
to it with one gradient step. The model is an unmodified Keras 3 MLP (1-40-40-1,
ReLU). The inner step *writes the model's weights*, with a Keras ``SGD``
optimizer (MAML) or with ``assign_sub`` and a learned per-parameter step size
(Meta-SGD), and the meta-gradient flows back through those writes, because the
whole meta-batch runs under one ``AssignAwareTape``::

    with AssignAwareTape() as tape:
        for task in meta_batch:
            with tape.restoring(model.trainable_variables):
                inner_sgd.apply_gradients(zip(grads_on_support, weights))
                query_losses.append(mse(model(x_query), y_query))
    meta_grads = tape.gradient(mean(query_losses), weights)

Nothing else is special: no functional re-implementation of the model, no
weights passed as tensors. The report compares the mean squared error on 600
held-out tasks after 0, 1 and 10 adaptation steps with a model pretrained on all
tasks and fine-tuned the same way, and saves the adaptation curves as a PNG
(with matplotlib, ``pip install "assigntape[examples]"``).

``--inner-steps 200 --unroll`` runs MAML with a long inner loop instead: each
task adapts with 200 Keras ``SGD`` steps, and the meta-gradient flows back
through all of them under ``assigntape.unroll``, which keeps the weights only
every ``ceil(sqrt(steps))`` steps and runs the steps in between again in the
backward pass::

    with AssignAwareTape() as tape:
        unroll(inner_step, steps)  # the same as: for _ in range(steps): inner_step()
        query_loss = mse(model(x_query), y_query)
    meta_grads = tape.gradient(query_loss, weights)

It first takes one task's meta-gradient both with ``unroll`` and with the
plain loop, and prints the peak resident memory of each (Linux) and how far
apart the two gradients are; then it trains (eagerly, ``--meta-steps``
meta-steps of ``--meta-batch`` tasks, default 10 of 2, each task on its own tape).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from assigntape import AssignAwareTape, unroll  # noqa: E402
from assigntape.examples import _report  # noqa: E402

__all__ = [
    "Config",
    "SineTasks",
    "build_model",
    "meta_gradients",
    "run",
    "main",
    "UnrollConfig",
    "task_meta_gradient",
    "run_unroll",
]


@dataclasses.dataclass
class Config:
    """One run. The defaults are the full run whose figures docs/use-cases/meta-learning.md shows."""

    iterations: int = 15000  # meta-steps for MAML and for Meta-SGD
    baseline_iterations: int = 15000  # steps of the pretrained baseline
    meta_batch: int = 25  # tasks per meta-step
    shots: int = 10  # K: support points per task (and query points in training)
    inner_lr: float = 0.01  # alpha: the inner SGD step size (Meta-SGD's initial one)
    meta_lr: float = 1e-3  # Adam's learning rate for the meta-update
    eval_tasks: int = 600
    eval_points: int = 100  # query points per held-out task
    eval_steps: int = 10  # adaptation steps in evaluation
    seed: int = 0
    compiled: bool = True  # run the meta-step under tf.function
    plot: Optional[str] = "maml_sine.png"
    progress: bool = True


class SineTasks:
    """Samples sinusoid tasks and points."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def tasks(self, n: int) -> Tuple[np.ndarray, np.ndarray]:
        amplitude = self._rng.uniform(0.1, 5.0, size=(n, 1, 1))
        phase = self._rng.uniform(0.0, math.pi, size=(n, 1, 1))
        return amplitude, phase

    def points(self, amplitude: np.ndarray, phase: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
        x = self._rng.uniform(-5.0, 5.0, size=(amplitude.shape[0], k, 1))
        return x.astype(np.float32), (amplitude * np.sin(x - phase)).astype(np.float32)

    def meta_batch(self, n: int, k: int) -> Tuple[np.ndarray, ...]:
        """(x_support, y_support, x_query, y_query), each of shape [n, k, 1]."""
        amplitude, phase = self.tasks(n)
        return self.points(amplitude, phase, k) + self.points(amplitude, phase, k)


def build_model(seed: int) -> keras.Model:
    """The 1-40-40-1 ReLU MLP of Finn et al., as a plain Keras 3 model."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential(
        [
            keras.Input((1,)),
            keras.layers.Dense(40, activation="relu", kernel_initializer=init(seed)),
            keras.layers.Dense(40, activation="relu", kernel_initializer=init(seed + 1)),
            keras.layers.Dense(1, kernel_initializer=init(seed + 2)),
        ]
    )


def _mse(prediction: Any, y: Any) -> Any:
    return tf.reduce_mean(tf.square(prediction - y))


def meta_gradients(
    model: keras.Model,
    batch: Sequence[Any],
    inner_optimizer: Optional[keras.optimizers.Optimizer] = None,
    step_sizes: Optional[Sequence[Any]] = None,
) -> Tuple[Any, List[Any]]:
    """The meta-loss of one meta-batch and its gradients, through the inner writes.

    Args:
      model: the Keras model whose weights the inner step writes.
      batch: ``(x_support, y_support, x_query, y_query)``, each ``[tasks, k, 1]``.
      inner_optimizer: MAML: a Keras optimizer for the inner step (SGD with the
        inner learning rate). Its ``apply_gradients`` writes the weights.
      step_sizes: Meta-SGD: one variable per trainable weight, the same shape,
        holding that weight's learned step sizes; the inner step is
        ``w.assign_sub(step_size * grad)``.

    Returns:
      ``(meta_loss, grads)``: grads for ``model.trainable_variables`` then, with
      Meta-SGD, for ``step_sizes``.
    """
    weights = model.trainable_variables
    xs, ys, xq, yq = batch
    losses = []
    with AssignAwareTape() as tape:
        for t in range(int(xs.shape[0])):
            # Every task adapts from the same start: the weights are written back
            # after the task, and the next task's gradient still reaches them.
            with tape.restoring(weights):
                with tf.GradientTape() as inner:
                    support_loss = _mse(model(xs[t]), ys[t])
                grads = inner.gradient(support_loss, weights)
                if step_sizes is None:
                    assert inner_optimizer is not None
                    inner_optimizer.apply_gradients(zip(grads, weights))
                else:
                    for w, alpha, g in zip(weights, step_sizes, grads):
                        w.assign_sub(alpha * g)
                losses.append(_mse(model(xq[t]), yq[t]))
        meta_loss = tf.add_n(losses) / len(losses)
    sources = list(weights) + list(step_sizes or [])
    return meta_loss, tape.gradient(meta_loss, sources)


class _Learner:
    """A meta-learner: model, its inner step, and the Adam meta-optimizer."""

    def __init__(self, config: Config, meta_sgd: bool) -> None:
        self.model = build_model(config.seed)
        weights = self.model.trainable_variables
        self.step_sizes: Optional[List[Any]] = None
        self.inner_optimizer: Optional[keras.optimizers.Optimizer] = None
        if meta_sgd:
            self.step_sizes = [
                tf.Variable(tf.fill(w.shape, config.inner_lr), name="alpha_" + w.name.replace("/", "_"))
                for w in weights
            ]
        else:
            self.inner_optimizer = keras.optimizers.SGD(config.inner_lr)
            self.inner_optimizer.build(weights)
        self.meta_optimizer = keras.optimizers.Adam(config.meta_lr)
        self.params = list(weights) + list(self.step_sizes or [])
        self.meta_optimizer.build(self.params)
        self.step = tf.function(self._step) if config.compiled else self._step

    def _step(self, batch: Sequence[Any]) -> Any:
        loss, grads = meta_gradients(self.model, batch, self.inner_optimizer, self.step_sizes)
        self.meta_optimizer.apply_gradients(zip(grads, self.params))
        return loss

    def adaptation(self) -> Tuple[List[np.ndarray], Any]:
        """The weights, and the step sizes that evaluation adapts them with."""
        weights = [w.numpy() for w in self.model.trainable_variables]
        if self.step_sizes is None:
            return weights, None
        return weights, [a.numpy() for a in self.step_sizes]


class _Pretrained:
    """The baseline: one model trained on points from all tasks at once."""

    def __init__(self, config: Config) -> None:
        self.model = build_model(config.seed)
        self.optimizer = keras.optimizers.Adam(config.meta_lr)
        self.optimizer.build(self.model.trainable_variables)
        self.step = tf.function(self._step) if config.compiled else self._step

    def _step(self, batch: Sequence[Any]) -> Any:
        xs, ys, xq, yq = batch
        x, y = tf.concat([xs, xq], 1), tf.concat([ys, yq], 1)
        weights = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = _mse(self.model(tf.reshape(x, [-1, 1])), tf.reshape(y, [-1, 1]))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return loss


# -- evaluation: all held-out tasks at once, weights as batched tensors --------


def _forward(params: Sequence[Any], x: Any) -> Any:
    """The MLP on a batch of tasks: params[i] has a leading task axis."""
    h = x
    for i in range(0, len(params), 2):
        h = tf.matmul(h, params[i]) + params[i + 1][:, None, :]
        if i + 2 < len(params):
            h = tf.nn.relu(h)
    return h


@tf.function
def _adapt(
    params: List[Any], step_sizes: List[Any], xs: Any, ys: Any, xq: Any, yq: Any, steps: int
) -> Tuple[Any, List[Any]]:
    """Per-step mean query MSE (steps + 1 values) and the adapted params."""

    def query_mse(params: List[Any]) -> Any:
        return tf.reduce_mean(tf.square(_forward(params, xq) - yq))

    curve = [query_mse(params)]
    for _ in range(steps):
        with tf.GradientTape() as tape:
            tape.watch(params)
            # Each task's loss depends only on its own slice of the params, so
            # the gradient of the sum is every task's own gradient.
            per_task = tf.reduce_mean(tf.square(_forward(params, xs) - ys), axis=[1, 2])
            total = tf.reduce_sum(per_task)
        grads = tape.gradient(total, params)
        params = [p - a * g for p, a, g in zip(params, step_sizes, grads)]
        curve.append(query_mse(params))
    return tf.stack(curve), params


def evaluate(
    weights: Sequence[np.ndarray],
    step_sizes: Optional[Sequence[np.ndarray]],
    inner_lr: float,
    held_out: Tuple[np.ndarray, ...],
    steps: int,
) -> np.ndarray:
    """Mean query MSE over the held-out tasks after 0..steps adaptation steps."""
    n = held_out[0].shape[0]
    params = [tf.constant(np.broadcast_to(w, (n,) + w.shape)) for w in weights]
    if step_sizes is None:
        sizes = [tf.constant(inner_lr, tf.float32)] * len(weights)
    else:
        sizes = [tf.constant(a) for a in step_sizes]
    curve, _ = _adapt(params, sizes, *[tf.constant(a) for a in held_out], steps)
    values: np.ndarray = curve.numpy()
    return values


def _held_out(config: Config) -> Tuple[np.ndarray, ...]:
    tasks = SineTasks(config.seed + 10_000)  # disjoint from the training stream
    amplitude, phase = tasks.tasks(config.eval_tasks)
    return tasks.points(amplitude, phase, config.shots) + tasks.points(amplitude, phase, config.eval_points)


def _train(name: str, step: Any, config: Config, iterations: int, seed: int) -> List[float]:
    tasks = SineTasks(seed)
    bar = keras.utils.Progbar(iterations, stateful_metrics=["loss"], verbose=1 if config.progress else 0)
    if config.progress:
        print(name)
    losses = []
    for i in range(iterations):
        batch = [tf.constant(a) for a in tasks.meta_batch(config.meta_batch, config.shots)]
        losses.append(float(step(batch)))
        if (i + 1) % 50 == 0 or i + 1 == iterations:
            bar.update(i + 1, [("loss", float(np.mean(losses[-50:])))])
    return losses


def run(config: Config) -> Dict[str, Any]:
    """Trains MAML, Meta-SGD and the pretrained baseline, then evaluates them.

    Returns a dict with, per method, the adaptation curve (mean held-out MSE
    after 0..eval_steps steps) and the training losses, the elapsed seconds,
    and the plot's path (or None).
    """
    start = time.perf_counter()
    keras.utils.set_random_seed(config.seed)
    held_out = _held_out(config)
    results: Dict[str, Any] = {"config": dataclasses.asdict(config), "methods": {}}
    for name, meta_sgd in (("MAML", False), ("Meta-SGD", True)):
        learner = _Learner(config, meta_sgd)
        losses = _train(name, learner.step, config, config.iterations, config.seed + 1)
        weights, sizes = learner.adaptation()
        results["methods"][name] = {
            "curve": evaluate(weights, sizes, config.inner_lr, held_out, config.eval_steps).tolist(),
            "train_loss": losses,
            "weights": weights,
            "step_sizes": sizes,
        }
    baseline = _Pretrained(config)
    losses = _train("pretrained on all tasks", baseline.step, config, config.baseline_iterations, config.seed + 1)
    weights = [w.numpy() for w in baseline.model.trainable_variables]
    results["methods"]["pretrained"] = {
        "curve": evaluate(weights, None, config.inner_lr, held_out, config.eval_steps).tolist(),
        "train_loss": losses,
        "weights": weights,
        "step_sizes": None,
    }
    results["seconds"] = time.perf_counter() - start
    results["plot"] = _plot(results, held_out, config) if config.plot else None
    return results


def _plot(results: Dict[str, Any], held_out: Tuple[np.ndarray, ...], config: Config) -> Optional[str]:
    plt = _report.pyplot()
    if plt is None:
        return None
    fig, (curves, fit) = plt.subplots(1, 2, figsize=(11, 4))
    for name, method in results["methods"].items():
        curves.plot(range(len(method["curve"])), method["curve"], marker="o", label=name)
    curves.set(
        xlabel=f"adaptation steps on K = {config.shots} points",
        yscale="log",
        ylabel=f"mean squared error, {config.eval_tasks} held-out tasks",
    )
    # Meta-SGD's step sizes are learned for one step; repeated, they can diverge.
    # Keep the axis on the range that matters.
    start = max(m["curve"][0] for m in results["methods"].values())
    curves.set_ylim(top=4 * start)
    curves.legend()
    curves.set_title("Adaptation to new sine tasks")
    # One held-out task: the truth, its K points, and each method after 1 step.
    xs, ys, xq, yq = (a[:1] for a in held_out)
    grid = np.linspace(-5, 5, 200, dtype=np.float32)[None, :, None]
    order = np.argsort(xq[0, :, 0])
    fit.plot(xq[0, order, 0], yq[0, order, 0], "k-", lw=2, label="task")
    fit.plot(xs[0, :, 0], ys[0, :, 0], "k^", label="K points")
    for name, method in results["methods"].items():
        params = [tf.constant(w[None]) for w in method["weights"]]
        sizes = [tf.constant(config.inner_lr)] * len(params)
        if method["step_sizes"] is not None:
            sizes = [tf.constant(a) for a in method["step_sizes"]]
        _, adapted = _adapt(params, sizes, xs, ys, xq, yq, 1)
        fit.plot(grid[0, :, 0], _forward(adapted, grid).numpy()[0, :, 0], "--", label=f"{name}, 1 step")
    fit.legend(fontsize=8)
    fit.set_title("One held-out task, after one step")
    assert config.plot is not None
    return _report.save(fig, config.plot)


def report(results: Dict[str, Any]) -> str:
    """The results table, and what it shows."""
    config = results["config"]
    steps = config["eval_steps"]
    shown = [0, 1, steps]
    header = f"{'method':<26}" + "".join(f"{f'{s} step' + ('s' if s != 1 else ''):>12}" for s in shown)
    lines = [
        f"Mean squared error on {config['eval_tasks']} held-out tasks, K = {config['shots']}, "
        f"after adaptation steps (alpha = {config['inner_lr']}):",
        header,
        "-" * len(header),
    ]
    for name, method in results["methods"].items():
        lines.append(f"{name:<26}" + "".join(_report.number(method["curve"][s], ".3f", 12) for s in shown))
    maml, meta_sgd, base = (results["methods"][k]["curve"][1] for k in ("MAML", "Meta-SGD", "pretrained"))
    lines += [
        "",
        f"MAML after 1 step: {_report.number(maml, '.3f')}; the pretrained baseline after 1 step: "
        f"{_report.number(base, '.3f')} ({_report.number(base / maml, '.1f')}x MAML's)",
        f"Meta-SGD after 1 step: {_report.number(meta_sgd, '.3f')}; its step sizes are learned "
        "for one step, and repeated they may diverge",
        f"{config['iterations']} meta-steps each, {'compiled' if config['compiled'] else 'eager'}",
    ]
    return "\n".join(lines + _report.footer(results))


# -- long inner loops under unroll (--inner-steps N --unroll) -------------------


@dataclasses.dataclass
class UnrollConfig:
    """One run of MAML with a long inner loop."""

    inner_steps: int = 200
    unroll: bool = True  # train with unroll (else the plain loop)
    meta_steps: int = 10
    meta_batch: int = 2  # tasks per meta-step (each its own tape: memory is per task)
    shots: int = 10
    inner_lr: float = 0.01
    meta_lr: float = 1e-3
    seed: int = 0
    progress: bool = True


def task_meta_gradient(
    model: keras.Model, optimizer: keras.optimizers.Optimizer, task: Sequence[Any], steps: int, use_unroll: bool
) -> Tuple[Any, List[Any]]:
    """One task's query loss after ``steps`` inner SGD steps on its support
    set, and its gradient with respect to the weights before them; the
    weights are put back afterwards.

    ``use_unroll``: the steps run under ``unroll`` (else the plain loop)."""
    weights = model.trainable_variables
    xs, ys, xq, yq = task
    start = [w.numpy() for w in weights]

    def inner_step() -> Any:
        with tf.GradientTape() as inner:
            support_loss = tf.reduce_mean(tf.square(model(xs) - ys))
        optimizer.apply_gradients(zip(inner.gradient(support_loss, weights), weights))
        return support_loss

    with AssignAwareTape() as tape:
        if use_unroll:
            unroll(inner_step, steps)
        else:
            for _ in range(steps):
                inner_step()
        query_loss = tf.reduce_mean(tf.square(model(xq) - yq))
    grads = tape.gradient(query_loss, weights)
    for w, s in zip(weights, start):
        w.assign(s)
    return query_loss, grads


def _peak_mib(step: Callable[[], Any]) -> Tuple[Any, Optional[float]]:
    """``step()``, and the peak resident set while it ran above the resident
    set before it, in MiB (None where /proc does not tell: not Linux)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what malloc kept for reuse is not counted as in use
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from now
    except OSError:
        return step(), None
    result = step()
    return result, (_status("VmHWM") - before) / 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(field)


def run_unroll(config: UnrollConfig) -> Dict[str, Any]:
    """Measures the first task's meta-gradient with ``unroll`` and with the
    plain loop (memory, and how far apart), then trains MAML.

    Returns a dict with the peaks (MiB), both first gradients, their largest
    relative difference, the training losses and the elapsed seconds.
    """
    start = time.perf_counter()
    keras.utils.set_random_seed(config.seed)
    model = build_model(config.seed)
    weights = model.trainable_variables
    optimizer = keras.optimizers.SGD(config.inner_lr)
    optimizer.build(weights)  # no variable may be created inside an unrolled step
    tasks = SineTasks(config.seed + 1)
    first = [tf.constant(a[0]) for a in tasks.meta_batch(1, config.shots)]
    # (Both run once on a few steps first: what a first call of the ops and
    # the library sets up is not either's.)
    for use_unroll in (True, False):
        task_meta_gradient(model, optimizer, first, min(config.inner_steps, 4), use_unroll)
    # unroll first: what the plain loop leaves malloc holding is then not
    # counted in unroll's baseline (the plain loop's figure is, if anything, low).
    (_, unrolled), unroll_peak = _peak_mib(
        lambda: task_meta_gradient(model, optimizer, first, config.inner_steps, True)
    )
    (_, plain), plain_peak = _peak_mib(lambda: task_meta_gradient(model, optimizer, first, config.inner_steps, False))
    difference = max(
        float(np.max(np.abs(u - p)) / (np.max(np.abs(p)) + 1e-30)) for u, p in zip(unrolled, plain) if p is not None
    )
    meta_optimizer = keras.optimizers.Adam(config.meta_lr)
    meta_optimizer.build(weights)
    bar = keras.utils.Progbar(config.meta_steps, stateful_metrics=["loss"], verbose=1 if config.progress else 0)
    losses = []
    for i in range(config.meta_steps):
        batch = [tf.constant(a) for a in tasks.meta_batch(config.meta_batch, config.shots)]
        total: List[Any] = [tf.zeros_like(w) for w in weights]
        loss = 0.0
        for t in range(config.meta_batch):
            task_loss, grads = task_meta_gradient(
                model, optimizer, [a[t] for a in batch], config.inner_steps, config.unroll
            )
            total = [a + g / config.meta_batch for a, g in zip(total, grads)]
            loss += float(task_loss) / config.meta_batch
        meta_optimizer.apply_gradients(zip(total, weights))
        losses.append(loss)
        bar.update(i + 1, [("loss", loss)])
    return {
        "config": dataclasses.asdict(config),
        "unroll_peak_mib": unroll_peak,
        "plain_peak_mib": plain_peak,
        "first_gradients": {"unroll": unrolled, "plain": plain},
        "max_relative_difference": difference,
        "train_loss": losses,
        "seconds": time.perf_counter() - start,
    }


def report_unroll(results: Dict[str, Any]) -> str:
    config = results["config"]
    steps = config["inner_steps"]

    def mib(x: Optional[float]) -> str:
        return "not measured (Linux only)" if x is None else f"{x:.1f} MiB"

    lines = [
        f"One task's meta-gradient through {steps} inner SGD steps (eager), peak resident memory:",
        f"  unroll (segments of {max(1, int(np.ceil(np.sqrt(steps))))} steps): {mib(results['unroll_peak_mib'])}",
        f"  plain reverse mode:{' ' * 14}{mib(results['plain_peak_mib'])}",
        f"  largest relative difference of the two gradients: {results['max_relative_difference']:.1e}",
    ]
    if results["train_loss"]:
        trained = "unroll" if config["unroll"] else "the plain loop"
        lines.append(
            f"MAML, {config['meta_steps']} meta-steps of {config['meta_batch']} tasks with {trained}: query loss "
            f"{_report.number(results['train_loss'][0], '.3f')} -> {_report.number(results['train_loss'][-1], '.3f')}"
        )
    return "\n".join(lines + _report.footer(results))


def _parse(argv: Optional[Sequence[str]]) -> Union[Config, UnrollConfig]:
    defaults = Config()
    parser = _report.parser("maml_sine", __doc__, defaults.plot, "run the meta-step eagerly (slow)")
    parser.add_argument("--iterations", type=int, default=defaults.iterations, help="meta-steps per method")
    parser.add_argument("--baseline-iterations", type=int, default=None, help="default: --iterations")
    parser.add_argument("--meta-batch", type=int, default=defaults.meta_batch)
    parser.add_argument("--eval-tasks", type=int, default=defaults.eval_tasks)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    long = UnrollConfig()
    parser.add_argument(
        "--inner-steps", type=int, default=None, help="MAML with this many inner steps per task (eager; see --unroll)"
    )
    parser.add_argument("--unroll", action="store_true", help="with --inner-steps: train under unroll")
    parser.add_argument("--meta-steps", type=int, default=long.meta_steps, help="with --inner-steps: meta-steps")
    args = parser.parse_args(argv)
    if args.inner_steps is not None:
        return UnrollConfig(
            inner_steps=args.inner_steps,
            unroll=args.unroll,
            meta_steps=args.meta_steps,
            meta_batch=args.meta_batch if args.meta_batch != defaults.meta_batch else long.meta_batch,
            seed=args.seed,
            progress=not args.quiet,
        )
    return Config(
        iterations=args.iterations,
        baseline_iterations=args.baseline_iterations or args.iterations,
        meta_batch=args.meta_batch,
        eval_tasks=args.eval_tasks,
        seed=args.seed,
        compiled=not args.eager,
        plot=args.plot or None,
        progress=not args.quiet,
    )


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    config = _parse(argv)
    if isinstance(config, UnrollConfig):
        return _report.run_and_print(run_unroll, report_unroll, config)
    return _report.run_and_print(run, report, config)


if __name__ == "__main__":
    main(sys.argv[1:])
