"""Code written against the flat layout still imports: an old module name gives the module at
its new place, the same object, with a DeprecationWarning naming the new place."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from ckptstore._moved import MOVED

pytestmark = pytest.mark.filterwarnings("ignore:ckptstore.*moved to:DeprecationWarning")


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_is_the_module_at_its_new_place(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new
    assert new.__spec__ is not None and new.__spec__.name == MOVED[old]


def test_the_old_name_warns_naming_the_new_one() -> None:
    code = (
        "import warnings; warnings.simplefilter('error');"
        "import ckptstore\n"
        "try:\n    import ckptstore.distributed\n"
        "except DeprecationWarning as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "ckptstore.distributed moved to ckptstore.integrations.distributed" in out.stdout


def test_names_that_became_packages_still_give_what_they_held() -> None:
    from ckptstore.replication import follow, replicate
    from ckptstore.replication.replicator import follow as follow_at
    from ckptstore.replication.replicator import replicate as replicate_at
    from ckptstore.tiers import LocalTier, PersistPolicy
    from ckptstore.tiers.local import LocalTier as LocalTierAt
    from ckptstore.tiers.local import PersistPolicy as PolicyAt

    assert (follow, replicate, LocalTier, PersistPolicy) == (
        follow_at,
        replicate_at,
        LocalTierAt,
        PolicyAt,
    )


def test_a_patch_through_the_old_name_reaches_the_new_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("ckptstore.domain.layout.LATEST_NAME", "elsewhere.json")
    old = importlib.import_module("ckptstore.layout")
    assert old.LATEST_NAME == "elsewhere.json"
