"""Tools to test a store under failure: a fault-injecting S3 proxy and a kill fuzzer.

They ship with the package so that users can point them at their own setup: the proxy in front
of any S3-compatible server (``faultproxy``), the fuzzer against a local path or an embedded S3
server (``python -m ckptstore.testing.killfuzz``).
"""
