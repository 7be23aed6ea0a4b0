"""S3 as it misbehaves, for the suite and the scale benchmark: a fault-injecting proxy in front
of a real S3 server (faultproxy: dropped connections, stalls, error replies, the quirks of
S3-compatible servers, expiring keys), S3's request-rate limits (throttle), and rotating
credentials (rotation). Not part of the installed package: they test ckptstore, not a backend.
"""
