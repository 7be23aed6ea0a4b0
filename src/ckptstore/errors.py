"""One error tree for everything ckptstore raises.

Every message names the URI or file it concerns, what was expected, and how to fix it.
Third-party errors (botocore, OSError, fsspec) are translated once, at the backend boundary,
and chained with ``raise ... from e`` so the original stays visible in tracebacks.

The tree, and when each is raised::

    CheckpointError                  root: everything ckptstore raises on purpose
     +-- ConfigError                 bad user input: URI, scheme, option, step (a ValueError too)
     |    +-- ForeignTierError        a local tier's directory belongs to another store
     +-- NotFoundError               a step, object or store that should exist does not
     |    +-- WaitTimeoutError       no newer step was committed within a wait's timeout
     +-- IncompleteCheckpointError   a step lacks files its manifest lists, or was never committed
     +-- CorruptCheckpointError      stored bytes (or a manifest, pointer, lease) are unreadable
     |    +-- UntrustedCheckpointError  a manifest is unsigned or signed with another key
     +-- ConflictError               another writer got there first
     |    +-- ObjectExistsError      a create-only write found the object already there
     |    +-- PreconditionFailedError  a compare-and-swap found the object changed
     |    +-- LeaseHeldError         another live writer holds the store's writer lease
     |    +-- FencedError            this writer lost its lease: it must not commit any more
     |    +-- StepBehindLatestError  a save of a step older than ``latest`` (a run that forgot
     |                               to resume); ``allow_older=True`` saves it anyway
     +-- CompatibilityError          written by versions this reader refuses
     +-- SerializationError          the state holds what the safe format cannot represent
     |                               (a TypeError too)
     +-- UnsafeLoadError             loading would unpickle and the caller did not opt in
     +-- BackendError                the storage failed; ``retryable`` says if trying again helps
     |    +-- AccessDeniedError      credentials missing or wrong, or permission refused
     +-- DistributedCheckpointError  a multi-rank save or load failed; ``failures`` per rank
     +-- SaveAbandonedError          a background save was abandoned (Ctrl-C twice at exit)
     +-- DeadlineExceededError       a save or load ran past its deadline (ckptstore.deadline);
          |                          what was in flight was aborted
          +-- SaveTimeoutError       ... a save's: ``rank``, ``upload_id``, ``bytes_done``,
          |                          ``last_error`` say where it stood
          +-- LoadTimeoutError       ... a load's

Besides the message, every error carries what it is about as attributes, each ``None`` where
it does not apply (``str(e)`` is the message alone):

``uri``
    The full URI of the object the error is about, as the store's backend names it: the
    store's URI joined with ``path`` by ``/`` (``s3://bucket/run/latest.json``,
    ``/data/run/latest.json`` for a local store). When the error is about the store as a whole
    (no one object), the store's URI.
``path``
    The object's key relative to the store's root (``latest.json``,
    ``.ckptstore/lease.json``, ``global_step_7/...``): the key you pass to the backend. So
    whenever both are set, ``uri == join(store_uri, path)``
    (:func:`ckptstore.backends.base.error_context` builds the pair). Errors about the writer
    lease (``LeaseHeldError``, ``FencedError``) are about its record, ``.ckptstore/lease.json``.
    For an error about a local file outside any store (a push or pull directory, a signing-key
    file), that file's local path, and ``uri`` is ``None``.
``step``
    The training step concerned, where there is one. An error about a whole step (not one of
    its files) has the step's directory as its object: ``path="global_step_7"``.

The attributes survive pickling (errors cross process boundaries: multiprocessing, Ray,
torch.distributed), and :meth:`CheckpointError.add_context` fills in the ones a raise site
lower down could not know, such as the step of a backend error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, TypeVar

_E = TypeVar("_E", bound="CheckpointError")


class ErrorContext(TypedDict, total=False):
    """The keyword arguments ``uri``, ``step``, ``path``, to pass around and spread into an
    error: ``raise NotFoundError(message, **context)``."""

    uri: str | None
    step: int | None
    path: str | None


class CheckpointError(Exception):
    """Root of every error ckptstore raises on purpose.

    ``CheckpointError(message, *, uri=None, step=None, path=None)``: see the module docstring
    for what ``uri``, ``step`` and ``path`` hold. ``args`` is ``(message,)``, so ``str(e)`` is
    the message.
    """

    uri: str | None
    step: int | None
    path: str | None

    def __init__(
        self,
        message: str,
        *,
        uri: str | None = None,
        step: int | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.uri = uri
        self.step = step
        self.path = path

    def add_context(
        self: _E, *, uri: str | None = None, step: int | None = None, path: str | None = None
    ) -> _E:
        """Set those of ``uri``, ``step``, ``path`` that are still ``None``; returns ``self``,
        so a caller that knows more than the raise site can ``raise e.add_context(step=7)``."""
        if self.uri is None:
            self.uri = uri
        if self.step is None:
            self.step = step
        if self.path is None:
            self.path = path
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Every error of the tree is made from its message alone (the rest are keywords with
        # defaults); the state holds uri/step/path and any subclass attribute (retryable, ...).
        return (_rebuild, (type(self), self.args, self.__dict__.copy()))


def _rebuild(
    cls: type[CheckpointError], args: tuple[Any, ...], state: dict[str, Any]
) -> CheckpointError:
    """Unpickle an error: the class, its ``args`` (the message) and its attributes."""
    error = cls(*args[:1])
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigError(CheckpointError, ValueError):
    """Bad user input: a malformed URI, unknown scheme, invalid option or step."""


class ForeignTierError(ConfigError):
    """A local tier's directory belongs to another store (tiers/identity.py)."""


class NotFoundError(CheckpointError):
    """A step, object, bucket or store that should exist does not."""


class WaitTimeoutError(NotFoundError, TimeoutError):
    """``wait_for_step`` timed out: no step newer than the one waited past was committed."""


class IncompleteCheckpointError(CheckpointError):
    """A step lacks files its manifest lists (or was never committed)."""


class CorruptCheckpointError(CheckpointError):
    """Bytes in the store do not match what the manifest promises."""


class UntrustedCheckpointError(CorruptCheckpointError):
    """The manifest is unsigned or signed with another key, and the store requires its key."""


class ConflictError(CheckpointError):
    """Another writer got there first: the step is committed, or a compare-and-swap lost."""


class CompatibilityError(CheckpointError):
    """The checkpoint was written by versions this reader refuses (schema or library)."""


class SerializationError(CheckpointError, TypeError):
    """The state holds something the safe format cannot represent."""


class UnsafeLoadError(CheckpointError):
    """Loading would execute pickle from the store and the caller did not opt in."""


class BackendError(CheckpointError):
    """The storage failed. ``retryable`` says whether trying again may help."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        uri: str | None = None,
        step: int | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message, uri=uri, step=step, path=path)
        self.retryable = retryable


class DistributedCheckpointError(CheckpointError):
    """A multi-rank save or load failed; ``failures`` maps each failing rank (or node, or
    ``"coordinator"``) to its error. ``discarded``: the save's step is certainly not
    committed and its staged files are being removed, so each participant removes its own
    (a step that may be committed keeps them)."""

    def __init__(
        self,
        message: str,
        failures: Mapping[int | str, str] | None = None,
        *,
        uri: str | None = None,
        step: int | None = None,
        path: str | None = None,
        discarded: bool = False,
    ) -> None:
        super().__init__(message, uri=uri, step=step, path=path)
        self.failures: dict[int | str, str] = dict(failures or {})
        self.discarded = discarded


class AccessDeniedError(BackendError):
    """Credentials are missing, wrong or lack permission for the operation."""


class ObjectExistsError(ConflictError):
    """A create-only write found the object already there."""


class PreconditionFailedError(ConflictError):
    """A compare-and-swap found the object changed since it was read."""


class LeaseHeldError(ConflictError):
    """Another live writer holds the store's writer lease; ``takeover=True`` takes it."""


class FencedError(ConflictError):
    """This writer's lease was taken over: it must not commit or move ``latest`` any more."""


class StepBehindLatestError(ConflictError):
    """A save of a step older than ``latest``'s: a rerun that forgot to resume, whose saves
    retention would delete at once. Resume first, save into a new URI, or pass
    ``allow_older=True``."""


class SaveAbandonedError(CheckpointError):
    """A background save was abandoned before its commit (a second Ctrl-C while the process
    waited for it at exit): nothing was committed, its staged files were removed (what could
    not be is garbage that ``gc`` removes)."""


class DeadlineExceededError(CheckpointError):
    """A save or load ran past its deadline (:mod:`ckptstore.deadline`); what was in flight
    was aborted, a multipart upload included, or, where the server did not answer the abort,
    recorded and aborted by the next save, ``close()`` or ``gc`` (the message says which).

    Besides ``uri``/``path`` (the file being moved when time ran out) it carries, each
    ``None`` where unknown: ``rank`` (whose save), ``upload_id`` (the multipart upload in
    flight), ``bytes_done`` (of that file, when time ran out), ``last_error`` (the last
    retryable failure, as text: a stall, SlowDown, a reset) and ``timeout`` (the deadline's
    budget, in seconds). The message names them too. Raise it through
    :meth:`ckptstore.deadline.Deadline.error`, which writes that message.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        upload_id: str | None = None,
        bytes_done: int | None = None,
        last_error: str | None = None,
        timeout: float | None = None,
        uri: str | None = None,
        step: int | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message, uri=uri, step=step, path=path)
        self.rank = rank
        self.upload_id = upload_id
        self.bytes_done = bytes_done
        self.last_error = last_error
        self.timeout = timeout


class SaveTimeoutError(DeadlineExceededError):
    """A save ran past its deadline (``save_timeout``); nothing of it was committed by the
    request that timed out, and its multipart upload, if any, was aborted (or recorded, to be
    aborted later: the message says which)."""


class LoadTimeoutError(DeadlineExceededError):
    """A load ran past its deadline; the partial read was dropped."""


def bad_copy(error: CheckpointError) -> str:
    """What a verification error says of one tier's copy, without the advice its message
    gives a store of one tier ("Load an earlier step"): a store with another tier reads that
    tier's copy next, and the log must not tell it both (tiers/local.py, resolver.py)."""
    where = error.uri or "a file of the step"
    if isinstance(error, IncompleteCheckpointError):
        return f"{where} is missing"
    if isinstance(error, UntrustedCheckpointError):
        return f"{where} is not signed with this store's key"
    return f"{where} does not match its manifest (corrupt or truncated)"
