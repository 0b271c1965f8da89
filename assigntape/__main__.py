"""``python -m assigntape``: the reference cases, then the headline example.

The headline example is MAML and Meta-SGD on sine tasks, in a quick run of 3,000
meta-steps (``--full`` for the 15,000 of docs/use-cases/meta-learning.md). The other examples are listed
at the end, with the command that runs each.
"""

import sys
from typing import List

from assigntape.examples import maml_sine, seed_cases

QUICK_ITERATIONS = 3000

# The demo's last line: what it showed, and where a user reads on.
CLOSING = (
    "Shown: gradients that flow through variable writes, where tf.GradientTape gives None, "
    "and MAML through the writes of an unmodified Keras model's optimizer. "
    "Read next: docs/getting-started.md (the documentation site: mkdocs serve)."
)


def main(argv: List[str]) -> None:
    seed_cases.main()
    full = "--full" in argv
    argv = [a for a in argv if a != "--full"]
    if not full:
        argv = ["--iterations", str(QUICK_ITERATIONS), *argv]
    print()
    print(
        "MAML and Meta-SGD on sinusoid regression, an unmodified Keras MLP whose weights "
        f"the inner step writes ({'full' if full else 'quick'} run; "
        "python -m assigntape.examples.maml_sine --help for options):"
    )
    maml_sine.main(argv)
    print()
    print("More examples:")
    for name, what in [
        ("maml_sine", "MAML / Meta-SGD on sine tasks (the full run: python -m assigntape --full)"),
        ("hypergradient_lr", "learning-rate adaptation by hypergradient descent through Keras SGD"),
        ("soft_update_tau", "a learned soft-update coefficient tau, trained with model.fit"),
        ("seed_cases", "the reference cases above"),
    ]:
        print(f"  python -m assigntape.examples.{name:<18} {what}")
    print()
    print(CLOSING)


main(sys.argv[1:])
