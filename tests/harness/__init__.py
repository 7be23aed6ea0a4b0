"""Test-only machinery, not part of the installed package: the interleaving explorer (its
scheduler, scheduled backend, scenarios, jobs and invariant checks), the kill fuzzer, and the
stateful model of the public API. Run from the repository root with ``PYTHONPATH=tests``, e.g.
``PYTHONPATH=tests python -m harness.explore``."""
