"""Online learning-rate adaptation by hypergradient descent (Baydin et al. 2018).

Run with ``python -m assigntape.examples.hypergradient_lr`` (``--help`` for options).

A Keras 3 classifier is trained with Keras ``SGD``. Each step opens an
``AssignAwareTape`` around the optimizer step that applies the *previous*
gradient, then computes this step's loss. Because the optimizer's write is on the
tape, one ``gradient`` call gives both the new weight gradient (with respect to
the weights' latest version) and the hypergradient d loss / d lr, which is
``-grad_t . grad_{t-1}``::

    with AssignAwareTape() as tape:
        sgd.apply_gradients(zip(previous_grads, weights))   # reads lr
        loss = loss_fn(y, model(x))
    *grads, d_lr = tape.gradient(loss, [tape.versions(w)[-1] for w in weights] + [lr])

``--hypergradient forward`` computes ``d_lr`` in forward mode instead, with
``assigntape.ForwardAccumulator`` (the weight gradient then comes from a plain
tape inside it); the two agree to rounding::

    with ForwardAccumulator(lr, tf.constant(1.0)) as acc:
        sgd.apply_gradients(zip(previous_grads, weights))
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, weights)
    d_lr = acc.jvp(loss)

``--strategy mirrored`` trains the same step with ``model.fit`` under
``tf.distribute.MirroredStrategy`` on two logical CPUs: the step is a model's
``train_step``; each replica steps Keras ``SGD`` inside its own tape (the
optimizer all-reduces the gradients and updates every replica's copy of the
weights), and the replicas' hypergradients are summed. It prints the learning
rate after each step next to the same ``fit`` on one device, which it equals
to rounding.

The learning rate then moves against the hypergradient, with the normalised
multiplicative rule of the paper, ``lr *= 1 - beta * d_lr / (|grad_t| |grad_{t-1}|)``
(``--rule additive`` gives ``lr -= beta * d_lr``). Started 10x too small or 10x
too large, it finds its way to a good rate; the PNG shows loss and learning rate
over the steps against plain SGD at the same starting rates.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from assigntape import AssignAwareTape, ForwardAccumulator  # noqa: E402
from assigntape.examples import _report  # noqa: E402

__all__ = ["Config", "HypergradientTrainer", "hypergradient_step", "run", "run_distributed", "main"]


@dataclasses.dataclass
class Config:
    steps: int = 1000
    batch: int = 128
    good_lr: float = 1.0  # about the best fixed rate for this problem (see docs/use-cases/hypergradients.md)
    beta: float = 0.05  # the hypergradient step size
    rule: str = "multiplicative"  # or "additive"
    hypergradient: str = "reverse"  # or "forward" (ForwardAccumulator)
    seed: int = 0
    compiled: bool = True
    plot: Optional[str] = "hypergradient_lr.png"
    progress: bool = True
    strategy: str = "none"  # or "mirrored": fit on two logical CPUs, against one device


def _data(seed: int, n: int = 8192, dims: int = 20, classes: int = 5) -> Tuple[np.ndarray, np.ndarray]:
    """Overlapping Gaussian clusters: a classification problem with no download."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(classes, dims))
    labels = rng.integers(0, classes, n)
    x = means[labels] + 1.5 * rng.normal(size=(n, dims))
    return x.astype(np.float32), labels.astype(np.int32)


def _model(seed: int) -> keras.Model:
    init = keras.initializers.GlorotUniform
    return keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(32, activation="tanh", kernel_initializer=init(seed)),
            keras.layers.Dense(5, kernel_initializer=init(seed + 1)),
        ]
    )


def hypergradient_step(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    lr: tf.Variable,
    previous: Sequence[Any],
    x: Any,
    y: Any,
    mode: str = "reverse",
) -> Tuple[Any, List[Any], Any]:
    """Applies ``previous`` with ``optimizer``, then evaluates the loss on (x, y).

    Args:
      mode: ``"reverse"`` (one ``AssignAwareTape.gradient`` call) or
        ``"forward"`` (``d_lr`` as the jvp of a ``ForwardAccumulator``).

    Returns:
      ``(loss, grads, d_lr)``: the loss after the step, its gradient with respect
      to the weights as the step left them, and with respect to the learning
      rate the step used.
    """
    weights = model.trainable_variables
    if mode == "forward":
        with ForwardAccumulator(lr, tf.ones_like(lr)) as acc:
            optimizer.apply_gradients(zip(previous, weights))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
            grads = tape.gradient(loss, weights)
        return loss, grads, acc.jvp(loss)
    with AssignAwareTape() as tape:
        optimizer.apply_gradients(zip(previous, weights))
        logits = model(x)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    *grads, d_lr = tape.gradient(loss, [tape.versions(w)[-1] for w in weights] + [lr])
    return loss, grads, d_lr


class _Run:
    def __init__(self, config: Config, lr0: float, adapt: bool) -> None:
        keras.utils.set_random_seed(config.seed)
        self.config, self.adapt = config, adapt
        self.model = _model(config.seed)
        self.lr = tf.Variable(lr0, name="lr")
        # Keras 3 takes a callable for a learning rate it does not own.
        self.optimizer = keras.optimizers.SGD(learning_rate=lambda: self.lr)
        self.optimizer.build(self.model.trainable_variables)
        self.step = tf.function(self._step) if config.compiled else self._step

    def _step(self, previous: List[Any], x: Any, y: Any) -> Tuple[Any, List[Any]]:
        loss, grads, d_lr = hypergradient_step(
            self.model, self.optimizer, self.lr, previous, x, y, self.config.hypergradient
        )
        if self.adapt:
            if self.config.rule == "additive":
                self.lr.assign_sub(self.config.beta * d_lr)
            else:
                scale = tf.linalg.global_norm(grads) * tf.linalg.global_norm(previous)
                cosine = tf.math.divide_no_nan(d_lr, scale)  # 0 on the first step
                self.lr.assign(self.lr * (1.0 - self.config.beta * cosine))
        return loss, grads


class HypergradientTrainer(keras.Model):
    """The step as a model's ``train_step``, for ``fit`` under a strategy.

    The previous step's gradient is kept in non-trainable variables, one
    copy per replica (``aggregation=NONE``): each replica keeps the gradient
    of its share of the batch, and Keras ``SGD`` all-reduces what it is given,
    so the step applies the whole batch's gradient, as on one device. Each
    replica's loss is its share of the global batch's mean; the replicas'
    gradients, hypergradients and norms are summed with ``all_reduce``.
    """

    def __init__(self, net: keras.Model, lr0: float, config: Config) -> None:
        super().__init__()
        self.net, self.config = net, config
        self.lr = tf.Variable(lr0, trainable=False, name="lr")
        self.inner = keras.optimizers.SGD(learning_rate=lambda: self.lr * 1.0)
        self.previous = [
            tf.Variable(tf.zeros_like(w), trainable=False, aggregation=tf.VariableAggregation.NONE)
            for w in net.trainable_variables
        ]
        self.inner.build(net.trainable_variables)

    def call(self, x: Any) -> Any:
        return self.net(x)

    def train_step(self, data: Any) -> Dict[str, Any]:
        x, y = data
        weights = self.net.trainable_variables
        with AssignAwareTape() as tape:
            tape.watch(self.lr)  # not trainable (fit leaves it alone), so watched by hand
            self.inner.apply_gradients(zip([p.read_value() for p in self.previous], weights))
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, self.net(x))
            loss = tf.reduce_sum(losses) / self.config.batch  # this replica's share of the mean
        *grads, d_lr = tape.gradient(loss, [tape.versions(w)[-1] for w in weights] + [self.lr])
        # The replicas' sums, in one all-reduce: d lr, and this step's and the
        # previous step's gradients (for the norms of the whole batch's).
        previous = [p.read_value() for p in self.previous]
        ctx = tf.distribute.get_replica_context()
        flat = ctx.all_reduce("SUM", tf.concat([tf.reshape(t, [-1]) for t in [d_lr, *grads, *previous]], 0))
        total_d_lr, flat = flat[0], flat[1:]
        half = flat.shape[0] // 2
        if self.config.rule == "additive":
            self.lr.assign_sub(self.config.beta * total_d_lr)
        else:
            scale = tf.norm(flat[:half]) * tf.norm(flat[half:])
            cosine = tf.math.divide_no_nan(total_d_lr, scale)
            self.lr.assign(self.lr * (1.0 - self.config.beta * cosine))
        for p, g in zip(self.previous, grads):
            p.assign(g)
        return {"loss": ctx.all_reduce("SUM", loss)}


def _fit(config: Config, lr0: float, strategy: Any, batches: Tuple[np.ndarray, np.ndarray]) -> List[float]:
    """``fit`` of ``HypergradientTrainer`` on ``batches`` (in order) under
    ``strategy``: the learning rate after each step."""
    keras.utils.set_random_seed(config.seed)
    with strategy.scope():
        trainer = HypergradientTrainer(_model(config.seed), lr0, config)
        trainer.compile(run_eagerly=not config.compiled, jit_compile=False)
    rates: List[float] = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: rates.append(float(trainer.lr.numpy()))
    )
    x, y = batches
    trainer.fit(x, y, batch_size=config.batch, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    return rates


def _two_cpus() -> List[str]:
    """Two logical CPUs, made now if TensorFlow has not started yet."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        # (Listing the logical devices first would start TensorFlow.)
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError as e:
        if len(tf.config.list_logical_devices("CPU")) < 2:
            raise RuntimeError(
                "--strategy mirrored needs two logical CPUs, which can only be made before "
                "TensorFlow starts: run the example in a fresh process "
                "(python -m assigntape.examples.hypergradient_lr --strategy mirrored)."
            ) from e
    return [d.name for d in tf.config.list_logical_devices("CPU")[:2]]


def run_distributed(config: Config, strategy: Optional[Any] = None) -> Dict[str, Any]:
    """SGD-HD from a learning rate 10x too small, trained with ``fit`` on one
    device and under ``strategy`` (by default ``MirroredStrategy`` on two
    logical CPUs; pass the same one to run again in a process: a second
    strategy's collectives would clash with the first's), on the same batches.
    Returns ``{"rates": {"one device": [...], "mirrored": [...]}, ...}``."""
    if strategy is None:
        strategy = tf.distribute.MirroredStrategy(_two_cpus())
    start = time.perf_counter()
    x_all, y_all = _data(config.seed)
    rng = np.random.default_rng(config.seed + 1)  # the batches of run()
    idx = np.concatenate([rng.integers(0, len(x_all), config.batch) for _ in range(config.steps)])
    batches = (x_all[idx], y_all[idx])
    lr0 = config.good_lr / 10
    rates = {
        "one device": _fit(config, lr0, tf.distribute.get_strategy(), batches),
        "mirrored": _fit(config, lr0, strategy, batches),
    }
    return {"config": dataclasses.asdict(config), "rates": rates, "lr0": lr0, "seconds": time.perf_counter() - start}


def report_distributed(results: Dict[str, Any]) -> str:
    one, two = (np.asarray(r) for r in results["rates"].values())
    steps = len(one)
    shown = sorted({0, 1, 2, steps // 4, steps // 2, steps - 1} & set(range(steps)))
    lines = [
        f"SGD-HD from lr {results['lr0']:g} with fit: the learning rate after each step",
        f"{'step':>6}{'one device':>14}{'MirroredStrategy, 2 CPUs':>28}",
    ]
    lines += [f"{i + 1:>6}{one[i]:>14.6f}{two[i]:>28.6f}" for i in shown]
    lines.append(f"largest relative difference over {steps} steps: {np.max(np.abs(two - one) / np.abs(one)):.2e}")
    return "\n".join(lines + _report.footer(results))


def run(config: Config) -> Dict[str, Any]:
    """Plain SGD and SGD with hypergradient descent, from three starting rates.

    Returns ``{"runs": {label: {"loss": [...], "lr": [...]}}, "seconds", "plot"}``.
    """
    if config.rule not in ("multiplicative", "additive"):
        raise ValueError(f"rule must be 'multiplicative' or 'additive', got {config.rule!r}")
    if config.hypergradient not in ("reverse", "forward"):
        raise ValueError(f"hypergradient must be 'reverse' or 'forward', got {config.hypergradient!r}")
    start = time.perf_counter()
    x_all, y_all = _data(config.seed)
    starts = {"10x too small": config.good_lr / 10, "good": config.good_lr, "10x too large": config.good_lr * 10}
    runs: Dict[str, Dict[str, List[float]]] = {}
    bar = keras.utils.Progbar(len(starts) * 2 * config.steps, verbose=1 if config.progress else 0)
    done = 0
    for label, lr0 in starts.items():
        for adapt in (False, True):
            r = _Run(config, lr0, adapt)
            rng = np.random.default_rng(config.seed + 1)  # the same batches for every run
            previous = [tf.zeros_like(w) for w in r.model.trainable_variables]
            losses, rates = [], []
            for _ in range(config.steps):
                idx = rng.integers(0, len(x_all), config.batch)
                loss, previous = r.step(previous, tf.constant(x_all[idx]), tf.constant(y_all[idx]))
                losses.append(float(loss))
                rates.append(float(r.lr.numpy()))
                done += 1
                if done % 100 == 0:
                    bar.update(done)
            runs[f"{'SGD-HD' if adapt else 'SGD'}, lr0 {label} ({lr0:g})"] = {"loss": losses, "lr": rates}
    bar.update(done)
    results = {"config": dataclasses.asdict(config), "runs": runs, "seconds": time.perf_counter() - start}
    results["plot"] = _plot(results) if config.plot else None
    return results


def _smooth(values: Sequence[float], width: int = 25) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    width = max(1, min(width, len(v)))
    return np.convolve(v, np.ones(width) / width, mode="valid")


def _plot(results: Dict[str, Any]) -> Optional[str]:
    plt = _report.pyplot()
    if plt is None:
        return None
    fig, (losses, rates) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"too small": "tab:blue", "good": "tab:green", "too large": "tab:red"}
    for label, r in results["runs"].items():
        color = next(c for k, c in colors.items() if k in label)
        style = "-" if label.startswith("SGD-HD") else ":"
        losses.plot(_smooth(r["loss"]), style, color=color, label=label)
        rates.plot(r["lr"], style, color=color, label=label)
    losses.set(
        yscale="log",
        xlabel="step",
        ylabel="training loss (moving mean of 25)",
        title="Loss: dotted plain SGD, solid SGD-HD",
    )
    rates.set(yscale="log", xlabel="step", ylabel="learning rate", title="Learning rate")
    rates.legend(fontsize=7)
    return _report.save(fig, results["config"]["plot"])


def report(results: Dict[str, Any]) -> str:
    config = results["config"]
    tail = max(1, config["steps"] // 10)
    header = f"{'run':<40}{'final loss':>12}{'final lr':>12}"
    lines = [
        f"Training loss (mean of the last {tail} steps) and learning rate after {config['steps']} steps:",
        header,
        "-" * len(header),
    ]
    for label, r in results["runs"].items():
        lines.append(
            f"{label:<40}{_report.number(float(np.mean(r['loss'][-tail:])), '.4f', 12)}{_report.number(r['lr'][-1], '.4f', 12)}"
        )
    lines.append(f"{config['rule']} rule, beta = {config['beta']}, {config['hypergradient']}-mode hypergradient")
    return "\n".join(lines + _report.footer(results))


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    defaults = Config()
    parser = _report.parser("hypergradient_lr", __doc__, defaults.plot, "run the steps eagerly")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--beta", type=float, default=defaults.beta)
    parser.add_argument("--rule", choices=["multiplicative", "additive"], default=defaults.rule)
    parser.add_argument(
        "--hypergradient",
        choices=["reverse", "forward"],
        default=defaults.hypergradient,
        help="reverse: AssignAwareTape.gradient; forward: assigntape.ForwardAccumulator",
    )
    parser.add_argument(
        "--strategy",
        choices=["none", "mirrored"],
        default=defaults.strategy,
        help="mirrored: fit under MirroredStrategy on two logical CPUs, against one device",
    )
    args = parser.parse_args(argv)
    config = Config(
        steps=args.steps,
        beta=args.beta,
        rule=args.rule,
        hypergradient=args.hypergradient,
        compiled=not args.eager,
        plot=args.plot or None,
        progress=not args.quiet,
        strategy=args.strategy,
    )
    if config.strategy == "mirrored":
        return _report.run_and_print(run_distributed, report_distributed, config)
    return _report.run_and_print(run, report, config)


if __name__ == "__main__":
    main(sys.argv[1:])
