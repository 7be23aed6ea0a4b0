"""Tools to test a store and the storage under it, shipped so users can run them against their
own setup: the backend contract suite every backend must pass (``contract``), an embedded S3
server on loopback (``s3server``), and a fault-injecting S3 proxy with a model of S3's request
rate limits (``faultproxy``, ``throttle``). Test-only machinery (the interleaving explorer, the
kill fuzzer, the scale harness) lives in the repository's ``tests/harness`` and ``benchmarks``.
"""
