"""Backends: where bytes live (a local path, NFS, s3://, any fsspec URL), behind one small
protocol (base.py). They know nothing of checkpoints; registry.py opens one by URI scheme.
"""
