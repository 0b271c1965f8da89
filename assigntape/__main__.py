"""``python -m assigntape``: the reference cases, side by side."""

from assigntape.examples.seed_cases import main

main()
