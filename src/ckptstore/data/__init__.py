"""The data path: state dicts to files and back, snapshots, transfers, checked reads.

Nothing here decides whether a step exists: these modules move and check bytes, and hand them
to the core (core/) and the protocol (protocol/) to commit.
"""
