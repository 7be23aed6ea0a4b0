"""What ships for testing: the backend contract suite a third-party backend runs to show it
keeps the protocol (``contract``, as fsspec ships its abstract tests), and an embedded S3 server
on loopback (``s3server``: moto's, which ``ckptstore demo`` and "Try S3 locally" start). Both are
public. What tests ckptstore itself stays in the repository: the fault-injecting S3 proxy,
S3's rate limits and rotating credentials (``tests/s3faults``), the interleaving explorer and
the kill fuzzer (``tests/harness``), the scale harness (``benchmarks``).
"""
