"""Runnable examples: ``python -m assigntape.examples.<name>``."""
