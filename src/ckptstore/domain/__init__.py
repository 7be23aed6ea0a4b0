"""The domain: plain values and pure rules, no I/O.

Manifests and their schema, where objects live in a store (layout), retention policies, the
plan a participant of a save is handed, compatibility rules, checksums and signatures. Every
layer above uses these; they import nothing of ckptstore but errors and config, so they are
tested as tables of values.
"""
