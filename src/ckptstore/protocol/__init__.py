"""The commit protocol over one backend: how a step comes to exist, is found, and goes away.

The committer (commit.py) writes a step's manifest create-only after its payload, moves
``latest`` forward by compare-and-swap (pointer.py, cas.py) under the writer lease (lease*.py);
the catalog is the read side; removal, pruning, garbage collection, verification and adoption
keep the store healthy without ever showing a reader half a step (docs/design.md).
"""
