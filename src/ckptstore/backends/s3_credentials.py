"""Credentials that expire mid-save: renewed when the server says so, never frozen.

On AWS a job runs on temporary credentials (an assumed role, IRSA's web identity, the ECS or
EKS container endpoint, SSO, a ``credential_process``) that expire every hour or so. botocore
resolves them into one *refreshable* credentials object per session, and every request signs
with what it holds at that moment, refreshing it some minutes before the expiry the source
announced. That covers the common case, as long as nobody freezes the keys: this package never
copies them into a client, a thread or a worker process (each process builds its own client
from the same settings, and resolves the chain itself).

What botocore does not do: believe the server. A key the server refuses as expired before its
announced expiry (a clock minutes off, a role session revoked or rotated early, a token the
source replaced) fails every request until the advisory window opens, which is a long upload's
death (s3fs #500: ExpiredToken on UploadPart after 12 hours). So an answer in
:data:`~ckptstore.backends.s3_errors.EXPIRED` makes the retrier (s3_retry.py) ask
:meth:`Renewal.renew` for a new key, then retry the request; a multipart upload goes on with
its upload id, its parts done stay done. Renewal goes through botocore's own refresh (its lock,
its provider: the credential process runs, the role is assumed again), once per refused key
however many requests it refused at once.

botocore has no public call for "refresh now"; :meth:`Renewal.renew` uses the refreshable
object's refresh lock and its ``_protected_refresh``, the same steps its mandatory refresh
takes, and :meth:`Renewal.key` its current keys (``_frozen_credentials``), read without
starting a refresh. Where they are missing (static keys, a botocore that renamed them),
nothing is renewed: the request fails with AccessDeniedError naming the expired token.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)


class Renewal:
    """The credentials a client signs with, and a forced refresh of them."""

    def __init__(self, client: Any) -> None:
        signer = getattr(client, "_request_signer", None)
        self._source: Any = getattr(signer, "_credentials", None)
        self._lock = threading.Lock()
        self.renewals = 0
        """Keys replaced because the server refused them (for tests and logs)."""

    def key(self) -> str | None:
        """The access key the next request signs with (None where unknown). Read from the
        refreshable object's current keys without starting a refresh: a refresh (a credential
        process, a call to STS) belongs in the request's attempt, which runs by the deadline."""
        source = self._source
        if source is None:
            return None
        try:
            frozen = getattr(source, "_frozen_credentials", None)
            frozen = frozen if frozen is not None else source.get_frozen_credentials()
            return str(frozen.access_key)
        except Exception:  # a refresh that failed: the request's own attempt reports it
            return None

    def renew(self, refused: str | None) -> bool:
        """Replace the key ``refused`` (the one a request signed with) by a fresh one from the
        credential source; True once another key is in place (renewed now or meanwhile),
        False where the credentials cannot be refreshed or the source failed."""
        source = self._source
        refresh = getattr(source, "_protected_refresh", None)
        refresh_lock = getattr(source, "_refresh_lock", None)
        with self._lock:
            current = self.key()
            if current is not None and current != refused:
                return True  # renewed since that request was signed
            if refresh is None or refresh_lock is None:
                return False
            try:
                with refresh_lock:
                    refresh(is_mandatory=True)
            except Exception as e:  # the source failed (process, STS): the retrier tries again
                logger.warning("could not renew the expired AWS credentials: %s", e)
                return False
            self.renewals += 1
            renewed = self.key()
            logger.info("renewed the AWS credentials the server refused as expired")
            return renewed is not None and renewed != refused
