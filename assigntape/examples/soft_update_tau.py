"""A learned Polyak coefficient: ``tau`` trained through the soft target update.

Run with ``python -m assigntape.examples.soft_update_tau`` (``--help`` for options).

Target networks (DQN, DDPG, SAC, mean teachers, EMA weights) follow an online
network by soft updates, ``target.assign((1 - tau) * target + tau * online)``,
and ``tau`` is usually hand-tuned. Here it is learned: a Keras 3 model's
``train_step`` makes the soft update inside an ``AssignAwareTape`` and scores
the *updated target* on the incoming batch, which the online network has not been
trained on yet, so ``tau`` gets the gradient of that score through the write::

    with AssignAwareTape() as tape:
        tau = sigmoid(tau_logit)
        for t, o in zip(target.weights, online.weights):
            t.assign((1 - tau) * t + tau * online)
        loss = mse(y, target(x)) + mse(y, online(x))
    optimizer.apply_gradients(zip(tape.gradient(loss, trainable), trainable))

The model trains with ``model.fit`` (compiled, as Keras does by default) on two
streams of noisy linear-regression data, starting from ``tau = 0.1``. When the
true weights drift, the target must keep up: ``tau`` rises, and ends with a
lower target loss than any fixed ``tau`` of the sweep. When they stay put, a long
average would be best, but each step's gradient sees only that step's effect of
``tau``, and ``tau`` barely moves: a one-step hypergradient is myopic, and the
example shows that too. The report compares the learned ``tau`` with a sweep of
fixed ones, and the PNG shows ``tau`` over training.
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

from assigntape import AssignAwareTape  # noqa: E402
from assigntape.examples import _report  # noqa: E402

__all__ = ["Config", "SoftUpdateModel", "run", "main"]

FIXED_TAUS = (0.01, 0.03, 0.1, 0.3, 1.0)


@dataclasses.dataclass
class Config:
    steps: int = 3000  # batches in each stream
    batch: int = 16
    dims: int = 8
    noise: float = 2.0
    lr: float = 0.05  # SGD, for the online weights and tau's logit
    drift: float = 0.02  # per-step rotation of the true weights, in the drifting stream
    seed: int = 0
    run_eagerly: bool = False
    plot: Optional[str] = "soft_update_tau.png"
    progress: bool = True


class SoftUpdateModel(keras.Model):
    """An online linear model, a target copy that follows it, and a learned tau.

    ``learn_tau=False`` keeps ``tau`` fixed at ``tau0`` (the hand-tuned baseline).
    """

    def __init__(self, dims: int, tau0: float = 0.1, learn_tau: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.online = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed))
        self.target = keras.layers.Dense(1, kernel_initializer="zeros")
        self.target.trainable = False  # written only by the soft update
        logit = float(np.log(tau0 / (1.0 - tau0))) if tau0 < 1.0 else 30.0
        self.tau_logit = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(logit), trainable=learn_tau, name="tau_logit"
        )
        self.dims = dims

    def build(self, input_shape: Any) -> None:
        # Both networks now: ``call`` uses only the target, but the first
        # training step must already soft-update it from the online one.
        self.online.build(input_shape)
        self.target.build(input_shape)
        self.built = True

    @property
    def tau(self) -> Any:
        return tf.sigmoid(self.tau_logit)

    def call(self, x: Any) -> Any:
        return self.target(x)

    def train_step(self, data: Any) -> Dict[str, Any]:
        x, y = data
        with AssignAwareTape() as tape:
            tau = self.tau
            for t, o in zip(self.target.weights, self.online.weights):
                t.assign((1.0 - tau) * t + tau * o)
            target_loss = tf.reduce_mean(tf.square(self.target(x) - y))
            online_loss = tf.reduce_mean(tf.square(self.online(x) - y))
            loss = target_loss + online_loss
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"target_loss": target_loss, "tau": tau}


def _stream(config: Config, drifting: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, true weights per sample): noisy y = x . w_t, w_t fixed or rotating."""
    rng = np.random.default_rng(config.seed)
    n = config.steps * config.batch
    x = rng.normal(size=(n, config.dims)).astype(np.float32)
    u, v = np.linalg.qr(rng.normal(size=(config.dims, 2)))[0].T
    angle = (np.arange(n) // config.batch) * (config.drift if drifting else 0.0)
    w = 2.0 * (np.cos(angle)[:, None] * u + np.sin(angle)[:, None] * v)
    y = np.sum(x * w, axis=1, keepdims=True) + config.noise * rng.normal(size=(n, 1))
    return x, y.astype(np.float32), w.astype(np.float32)


class _TauLog(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.taus: List[float] = []
        self.errors: List[float] = []

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.taus.append(float((logs or {})["tau"]))
        self.errors.append(float((logs or {})["target_loss"]))


def _fit(config: Config, drifting: bool, tau0: float, learn_tau: bool) -> Dict[str, Any]:
    keras.utils.set_random_seed(config.seed)
    x, y, w = _stream(config, drifting)
    model = SoftUpdateModel(config.dims, tau0, learn_tau, config.seed)
    model.build((None, config.dims))
    model.compile(optimizer=keras.optimizers.SGD(config.lr), run_eagerly=config.run_eagerly)
    log = _TauLog()
    model.fit(x, y, batch_size=config.batch, epochs=1, shuffle=False, verbose=0, callbacks=[log])
    # The target's loss on batches it has not been fitted to, over the last
    # tenth of the stream.
    tail = len(log.errors) // 10
    return {"tau": log.taus, "target_loss": log.errors, "final_target_loss": float(np.mean(log.errors[-tail:]))}


def run(config: Config) -> Dict[str, Any]:
    """Per stream: the learned-tau run, and a sweep of fixed taus for comparison."""
    start = time.perf_counter()
    streams: Dict[str, Any] = {}
    bar = keras.utils.Progbar(2 * (1 + len(FIXED_TAUS)), verbose=1 if config.progress else 0)
    done = 0
    for name, drifting in (("stationary", False), ("drifting", True)):
        learned = _fit(config, drifting, 0.1, True)
        done += 1
        bar.update(done)
        fixed = {}
        for tau in FIXED_TAUS:
            fixed[tau] = _fit(config, drifting, tau, False)["final_target_loss"]
            done += 1
            bar.update(done)
        streams[name] = {"learned": learned, "fixed": fixed}
    results = {"config": dataclasses.asdict(config), "streams": streams, "seconds": time.perf_counter() - start}
    results["plot"] = _plot(results) if config.plot else None
    return results


def _plot(results: Dict[str, Any]) -> Optional[str]:
    plt = _report.pyplot()
    if plt is None:
        return None
    fig, (taus, sweep) = plt.subplots(1, 2, figsize=(11, 4))
    for name, stream in results["streams"].items():
        line = taus.plot(stream["learned"]["tau"], label=f"{name} stream")[0]
        fixed = stream["fixed"]
        sweep.plot(list(fixed), list(fixed.values()), "o:", color=line.get_color(), label=f"{name}: fixed tau")
        sweep.plot(
            [stream["learned"]["tau"][-1]],
            [stream["learned"]["final_target_loss"]],
            "*",
            ms=14,
            color=line.get_color(),
            label=f"{name}: learned tau",
        )
    taus.set(
        yscale="log",
        xlabel="training step (model.fit, compiled)",
        ylabel="tau",
        title="Learned soft-update coefficient",
    )
    taus.legend()
    sweep.set(
        xscale="log",
        xlabel="tau (final)",
        ylabel="target network's loss, last 10% of the stream",
        title="Learned tau against fixed ones",
    )
    sweep.legend(fontsize=8)
    return _report.save(fig, results["config"]["plot"])


def report(results: Dict[str, Any]) -> str:
    lines = ["Target network's loss on incoming batches (last 10% of each stream):"]
    for name, stream in results["streams"].items():
        learned = stream["learned"]
        best = min(stream["fixed"], key=stream["fixed"].get)
        fixed = ", ".join(f"{t:g}: {_report.number(v, '.3f')}" for t, v in stream["fixed"].items())
        lines.append(
            f"  {name:<11} learned tau {learned['tau'][-1]:.3f} -> {_report.number(learned['final_target_loss'], '.3f')}"
            f"   fixed tau {fixed}   (best fixed: {best:g})"
        )
    return "\n".join(lines + _report.footer(results))


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    defaults = Config()
    parser = _report.parser("soft_update_tau", __doc__, defaults.plot, "model.fit with run_eagerly=True")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    args = parser.parse_args(argv)
    config = Config(steps=args.steps, run_eagerly=args.eager, plot=args.plot or None, progress=not args.quiet)
    return _report.run_and_print(run, report, config)


if __name__ == "__main__":
    main(sys.argv[1:])
