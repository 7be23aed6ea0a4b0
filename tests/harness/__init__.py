"""Test-only machinery, not part of the installed package: the interleaving explorer (its
scheduler, scheduled backend, scenarios, jobs and invariant checks), the kill fuzzer, the stateful
model of the public API, and nodes of a cluster in namespaces of their own (nodes.py). Run from
the repository root with ``PYTHONPATH=tests``, e.g.
``PYTHONPATH=tests python -m harness.explore``."""
