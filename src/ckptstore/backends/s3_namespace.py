"""The keys under an S3 store's root, taken many at a time: listings, deletes, unfinished writes.

The backend (s3.py) sends the requests about one object; the ones here cover many keys at once,
and retention and ``gc`` drive them. S3 has no directories, only keys: a listing asks for a key
prefix, page by page, and ``Delimiter="/"`` folds every key below the next ``/`` into one name.
Two kinds of key under the root are not the store's objects and never appear in a listing:
console "folder" markers (keys ending in ``/``) and the objects of a capability probe in flight
(:data:`.s3_probe.PROBE_PREFIX`). DeleteObjects takes a thousand keys a request and answers 200
even when some fail, so each batch's answer is read for per-key errors. What unfinished writes
leave behind, multipart uploads never completed and the probe objects of a process killed
mid-probe, is found by :meth:`Namespace.partial_writes` and removed by :meth:`Namespace.abort`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from botocore.exceptions import ClientError

from ckptstore.backends.base import ObjectInfo, PartialWrite
from ckptstore.backends.s3_errors import NOT_FOUND, Translator, is_unsupported
from ckptstore.backends.s3_probe import PROBE_PREFIX
from ckptstore.backends.s3_transfer import Transfers

DELETE_BATCH = 1000
"""Keys per DeleteObjects request: the most S3 takes."""


class Namespace:
    """The requests about many keys under one S3 backend's root.

    ``base`` is the root's key prefix (``""`` or ending in ``/``); paths in and out are relative
    to it. ``warn_once(topic, message)`` reports a lost guarantee (the backend's, once per topic).
    """

    def __init__(
        self,
        uri: str,
        base: str,
        transfers: Transfers,
        errors: Translator,
        warn_once: Callable[[str, str], None],
    ) -> None:
        self._uri = uri
        self._base = base
        self._transfers = transfers
        self._errors = errors
        self._warn_once = warn_once

    def objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose path starts with ``prefix``, recursively."""
        full = self._base + prefix
        with self._translated(full, "list"):
            for page in self._transfers.pages("list_objects_v2", full, "list", Prefix=full):
                for obj in page.get("Contents", ()):
                    rel = str(obj["Key"])[len(self._base) :]
                    if rel.endswith("/") or rel.startswith(PROBE_PREFIX):
                        continue  # console "folder" markers and in-flight probes
                    yield ObjectInfo(rel, int(obj["Size"]), obj["LastModified"].timestamp())

    def dirs(self, prefix: str) -> list[str]:
        """The names one level below ``prefix``, sorted: one delimited listing."""
        full = self._base + prefix
        if prefix and not full.endswith("/"):
            full += "/"
        names = []
        pages = self._transfers.pages("list_objects_v2", full, "list", Prefix=full, Delimiter="/")
        with self._translated(full, "list"):
            for page in pages:
                for common in page.get("CommonPrefixes", ()):
                    names.append(str(common["Prefix"])[len(full) :].rstrip("/"))
        return sorted(name for name in names if name)

    def delete(self, paths: Sequence[str]) -> None:
        """DeleteObjects in batches; a key that is already gone is not an error."""
        keys = [self._base + p for p in paths]
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i : i + DELETE_BATCH]
            with self._translated(batch[0], "delete"):
                resp = self._transfers.call(
                    "delete_objects",
                    batch[0],
                    "delete",
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            errors = [e for e in resp.get("Errors", ()) if e.get("Code") not in NOT_FOUND]
            if errors:  # DeleteObjects answers 200 and reports failures per key
                failed = ", ".join(
                    f"{self._transfers.name(str(e.get('Key', '?')))} ({e.get('Code')})"
                    for e in errors[:5]
                )
                target = f"{len(errors)} object(s) under {self._uri}"
                code = str(errors[0].get("Code", ""))
                raise self._errors.error(code, target, "delete", f"failed: {failed}")

    def partial_writes(self, prefix: str) -> list[PartialWrite]:
        """Unfinished multipart uploads, and probe objects a process killed mid-probe left."""
        return self._unfinished_uploads(prefix) + self._leftover_probes(prefix)

    def abort(self, partial: PartialWrite) -> None:
        """Abort the upload, or delete the probe object, that ``partial`` names."""
        if partial.path.startswith(PROBE_PREFIX):  # a probe object, not an upload
            self.delete([partial.path])
            return
        key = self._base + partial.path
        with self._translated(key, "abort the upload of"):
            self._transfers.abort(key, partial.upload_id)

    def _leftover_probes(self, prefix: str) -> list[PartialWrite]:
        if not PROBE_PREFIX.startswith(prefix):
            return []
        found = []
        full = self._base + PROBE_PREFIX
        with self._translated(full, "list"):
            for page in self._transfers.pages("list_objects_v2", full, "list", Prefix=full):
                for obj in page.get("Contents", ()):
                    rel = str(obj["Key"])[len(self._base) :]
                    found.append(PartialWrite(rel, "", obj["LastModified"].timestamp()))
        return found

    def _unfinished_uploads(self, prefix: str) -> list[PartialWrite]:
        full = self._base + prefix
        with self._translated(full, "list unfinished uploads under"):
            try:
                found = self._transfers.unfinished(full)
            except ClientError as e:
                if not is_unsupported(e):
                    raise
                self._warn_once(
                    "list-uploads",
                    f"{self._errors.endpoint} does not implement ListMultipartUploads: gc cannot "
                    f"find unfinished uploads under {self._uri}; add an "
                    "AbortIncompleteMultipartUpload lifecycle rule to the bucket instead",
                )
                return []
        abandoned = self._transfers.leftovers.abandoned
        return [
            PartialWrite(key[len(self._base) :], upload_id, t, abandoned(key, upload_id))
            for key, upload_id, t in found
        ]

    def _translated(self, key: str, action: str) -> contextlib.AbstractContextManager[None]:
        return self._errors.translated(self._transfers.name(key), action)
