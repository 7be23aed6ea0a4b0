"""Credentials that rotate: keys that live N seconds, and an AWS profile that hands them out.

Why a ``credential_process`` and not a fake credentials object: the test then runs botocore's
real chain (the profile, the process provider, its refreshable credentials, their refresh lock
and advisory window) in every process of the job, as a role assumed through STS or IRSA's web
identity does; only the source differs. The fault proxy (faultproxy.py, ``key_lifetime``)
plays the server's part: it refuses a key ``key_lifetime`` seconds after it was issued with
S3's ``400 ExpiredToken``, as S3 refuses an expired session token.

A key carries its issue time (``ASIAROT<milliseconds since the epoch>``), so the proxy needs no
shared state with the processes that issue keys, whichever process or rank asked for one.
``announced`` is the expiry the process tells botocore, in seconds after issue: later than the
key's lifetime plus botocore's 15-minute advisory window, the server refuses the key first (a
clock off, a session revoked early) and only the client's renewal on ExpiredToken saves the
upload; shorter, botocore refreshes on its own first.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["PROFILE", "KEY_PREFIX", "issued_at", "key_of", "rotating_profile"]

PROFILE = "ckptstore-rotating"
KEY_PREFIX = "ASIAROT"
_KEY = re.compile(rf"^{KEY_PREFIX}(?P<ms>[0-9]{{13}})")
_CREDENTIAL = re.compile(r"Credential=(?P<key>[^/,\s]+)/")

ISSUER = """\
import datetime, json, sys, time
now = time.time()
announced, log = float(sys.argv[1]), sys.argv[2]
key = "%s%013d" % ({prefix!r}, int(now * 1000))
expires = datetime.datetime.fromtimestamp(now + announced, datetime.timezone.utc)
with open(log, "a") as f:
    f.write(key + "\\n")
print(json.dumps({{"Version": 1, "AccessKeyId": key, "SecretAccessKey": "rotating-secret",
                  "SessionToken": "token-" + key,
                  "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}}))
"""
"""The credential process: a new key each time it runs, logged to ``argv[2]``."""


def issued_at(key: str) -> float | None:
    """When a rotating key was issued (seconds since the epoch); None for any other key."""
    match = _KEY.match(key)
    return int(match["ms"]) / 1000 if match else None


def key_of(authorization: str) -> str | None:
    """The access key a SigV4 ``Authorization`` header was signed with."""
    match = _CREDENTIAL.search(authorization)
    return match["key"] if match else None


def rotating_profile(directory: Path, *, announced: float, region: str = "us-east-1") -> Path:
    """Write an AWS config file whose profile :data:`PROFILE` runs a credential process that
    issues a fresh key each time, announcing ``announced`` seconds of validity; returns the
    config file (point ``AWS_CONFIG_FILE`` at it). The keys issued are logged, one a line, to
    ``issued.log`` beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "issue_key.py"
    script.write_text(ISSUER.format(prefix=KEY_PREFIX))
    log = directory / "issued.log"
    config = directory / "config"
    config.write_text(
        f"[profile {PROFILE}]\nregion = {region}\n"
        f"credential_process = {sys.executable} {script} {announced:g} {log}\n"
    )
    return config
