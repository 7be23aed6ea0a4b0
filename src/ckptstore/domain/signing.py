"""Signed manifests: a writable bucket must not be enough to make a trainer resume from it.

verl's own loaders unpickle ``.pt`` files, and any loader trusts the manifest's checksums. So
whoever can write to the bucket could plant a step that a resume then executes. With a signing
key (HMAC-SHA256, from the constructor or from ``CKPTSTORE_SIGNING_KEY`` /
``CKPTSTORE_SIGNING_KEY_FILE``), every manifest a store writes carries a signature over all of
its fields, and a store that has a key refuses any step whose manifest is unsigned or signed
with another key. The refusal is a :class:`~ckptstore.errors.UntrustedCheckpointError`, a kind
of corruption, so ``load()`` falls back to the newest step that is signed correctly.

A signature over CRC32Cs alone would protect nothing: CRC32C is linear, and four chosen bytes
make any change keep it. So a signed manifest (schema 2) must carry a SHA-256 of every file,
computed while the bytes stream out, and loads check it. Manifests signed before digests
existed (schema 1) still load, with a warning that their bytes are covered by CRC32C only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import replace

from ckptstore.domain import layout
from ckptstore.domain.manifest import Manifest
from ckptstore.errors import ConfigError, ErrorContext, UntrustedCheckpointError

log = logging.getLogger(__name__)

_SCHEME = "hmac-sha256"


class Signer:
    """Signs and checks manifests with one key; the key never leaves this object."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ConfigError(
                "a manifest signing key must be at least 16 bytes (use e.g. "
                "`openssl rand -hex 32` and put it in CKPTSTORE_SIGNING_KEY)"
            )
        self._key = key
        self._warned: set[str] = set()
        self.key_id = hashlib.sha256(b"ckptstore-key-id:" + key).hexdigest()[:12]
        """Names the key in signatures and messages without revealing it."""

    def __repr__(self) -> str:
        return f"Signer(key_id={self.key_id!r})"

    def sign(self, manifest: Manifest) -> Manifest:
        return replace(manifest, signature=f"{_SCHEME}:{self.key_id}:{self._mac(manifest)}")

    def check(self, manifest: Manifest, where: str) -> None:
        """Raise UntrustedCheckpointError unless ``manifest`` is signed with this key;
        ``where`` is the manifest's URI (the error's ``uri``)."""
        context: ErrorContext = {
            "uri": where,
            "step": manifest.step,
            "path": layout.manifest_path(manifest.step),
        }
        if manifest.signature is None:
            raise UntrustedCheckpointError(
                f"{where}: the manifest is not signed, and this store requires signatures "
                f"(key id {self.key_id}); refusing it. Re-save the step with the key, or open "
                "the store without a signing key if you trust every writer",
                **context,
            )
        scheme, _, rest = manifest.signature.partition(":")
        key_id, _, mac = rest.partition(":")
        if scheme != _SCHEME or key_id != self.key_id:
            raise UntrustedCheckpointError(
                f"{where}: the manifest is signed with another key (key id {key_id or '?'}, "
                f"expected {self.key_id}); refusing it",
                **context,
            )
        if not hmac.compare_digest(mac, self._mac(manifest)):
            raise UntrustedCheckpointError(
                f"{where}: the manifest's signature does not match its contents (key id "
                f"{key_id}); it was altered after signing. Refusing it",
                **context,
            )
        undigested = [f.path for f in manifest.files if f.sha256 is None]
        if undigested and manifest.schema_version >= 2:
            raise UntrustedCheckpointError(
                f"{where}: the manifest is signed but lists no SHA-256 for {undigested[0]!r}; "
                "its bytes would be unprotected. Refusing it; save the step again with the key "
                "set on every process that stages files",
                **context,
            )
        if undigested and where not in self._warned:
            self._warned.add(where)
            log.warning(
                "%s was signed before SHA-256 digests (manifest schema 1): its payload bytes "
                "are checked by CRC32C only, which a forger can match. Re-save it to protect it",
                where,
            )

    def _mac(self, manifest: Manifest) -> str:
        return hmac.new(self._key, manifest.signed_bytes(), hashlib.sha256).hexdigest()
