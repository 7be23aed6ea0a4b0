"""The writer lease: one committing job per store, zombies fenced (lease.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ckptstore import CheckpointStore
from ckptstore.errors import FencedError, LeaseHeldError
from ckptstore.layout import LEASE_NAME


def open_store(store_uri: tuple[str, dict[str, Any]], **kwargs: Any) -> CheckpointStore:
    uri, options = store_uri
    return CheckpointStore(uri, storage_options=options, **kwargs)


def test_a_second_writer_is_refused_while_the_first_is_live(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    first = open_store(store_uri)
    first.save(1, {"step": 1})
    second = open_store(store_uri)
    with pytest.raises(LeaseHeldError) as caught:
        second.save(2, {"step": 2})
    message = str(caught.value)
    assert first.writer in message and "takeover=True" in message
    assert [i.step for i in second.list()] == [1]
    assert second.backend.stat("global_step_2/state.json") is None  # refused before uploading


def test_takeover_fences_the_zombie(store_uri: tuple[str, dict[str, Any]]) -> None:
    zombie = open_store(store_uri)
    zombie.save(1, {"step": 1})
    replacement = open_store(store_uri, takeover=True)
    replacement.save(2, {"step": 2})
    with pytest.raises(FencedError) as caught:
        zombie.save(3, {"step": 3})
    assert replacement.writer in str(caught.value)
    assert [i.step for i in replacement.list()] == [1, 2]
    assert replacement.latest().step == 2  # type: ignore[union-attr]
    replacement.save(3, {"step": 3})  # the replacement goes on
    assert replacement.latest().step == 3  # type: ignore[union-attr]


def test_a_fenced_writer_cannot_move_latest_even_past_its_check(
    store_uri: tuple[str, dict[str, Any]],
) -> None:
    zombie = open_store(store_uri)
    zombie.save(1, {"step": 1})
    open_store(store_uri, takeover=True).hold_lease()  # takes over, stamps latest
    assert zombie._lease is not None
    with pytest.raises(FencedError, match="newer writer lease"):
        zombie._committer.advance_latest(5, epoch=zombie._lease.epoch or 0)
    assert zombie.latest().step == 1  # type: ignore[union-attr]


def test_closing_releases_the_lease(store_uri: tuple[str, dict[str, Any]]) -> None:
    with open_store(store_uri) as first:
        first.save(1, {"step": 1})
    second = open_store(store_uri)
    second.save(2, {"step": 2})  # no takeover needed after a clean exit
    assert second.latest().step == 2  # type: ignore[union-attr]


def test_an_expired_lease_is_taken_without_asking(store_uri: tuple[str, dict[str, Any]]) -> None:
    now = [1000.0]
    first = open_store(store_uri, clock=lambda: now[0])
    first.save(1, {"step": 1})
    now[0] += 901  # the first writer has been silent for longer than the TTL
    second = open_store(store_uri, clock=lambda: now[0])
    second.save(2, {"step": 2})
    with pytest.raises(FencedError):
        first.save(3, {"step": 3})


def test_no_lease_means_shared_writing(store_uri: tuple[str, dict[str, Any]]) -> None:
    a = open_store(store_uri, lease=False)
    b = open_store(store_uri, lease=False)
    a.save(1, {"step": 1})
    b.save(2, {"step": 2})
    assert a.backend.stat(LEASE_NAME) is None
    assert a.latest().step == 2  # type: ignore[union-attr]
