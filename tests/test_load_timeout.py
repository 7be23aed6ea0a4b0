"""Every face's load runs by the store's ``load_timeout`` (the resolver's deadline,
resolver.py): over a backend whose reads trickle, a small ``load_timeout`` fails the load with
LoadTimeoutError naming the store, the step, what it was reading and the option, within the
timeout plus :data:`SLACK`, and leaves nothing partial behind (no ``global_step_N``, no pulled
directory, no export); the same load with no timeout succeeds. Every read of the load, choosing
the step included, runs under that one deadline.

The backend (tests/slow.py) slows only the reads of a step's payload files, so every load
first chooses its step (the error names it) and then runs out of time reading it. The CLI's
pull runs over the real S3 server (moto) behind the fault proxy, whose stalled GETs play the
slow backend. verl's resume runs its per-node agents in this process (LocalFleet), as
test_verl_integration does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.backends.local import LocalBackend
from ckptstore.cli.main import run
from ckptstore.domain.layout import LATEST_NAME, MANIFEST_NAME, VERL_TRACKER_NAME
from ckptstore.errors import LoadTimeoutError
from ckptstore.export import export_hf
from ckptstore.integrations.training_state import resume, training_state
from ckptstore.integrations.verl import prepare_resume
from ckptstore.integrations.verl_nodes import LocalFleet, NodeAgent
from s3faults.faultproxy import Fault, FaultProxy
from slow import Slow

pytestmark = pytest.mark.wallclock  # each asserts how soon the load fails

TIMEOUT = 0.5
"""The stores' ``load_timeout`` here, in seconds."""
PAUSE = 0.6
"""What each payload read waits when no deadline cuts it short."""
SLACK = 3.0
"""Seconds past the timeout a failure may take (generous: the machine is shared)."""


def payload(path: str) -> bool:
    """A step's payload file: not a manifest, nor the pointer."""
    return not path.endswith((MANIFEST_NAME, LATEST_NAME))


def slow_store(uri: str, timeout: float | None = TIMEOUT) -> CheckpointStore:
    backend = Slow(LocalBackend(uri, {}), PAUSE, slows=payload)
    return CheckpointStore(uri, backend=backend, lease=False, load_timeout=timeout)


def everything_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


def assert_times_out(load: Callable[[], object], step: int, store: str) -> LoadTimeoutError:
    """``load`` fails with the load's timeout error, in time, naming what it should."""
    started = time.monotonic()
    with pytest.raises(LoadTimeoutError) as caught:
        load()
    assert time.monotonic() - started < TIMEOUT + SLACK
    error = caught.value
    message = str(error)
    assert f"load of step {step}" in message and "load_timeout" in message
    assert "while trying to read" in message and store in message
    assert (error.step, error.timeout) == (step, TIMEOUT)
    return error


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)


@pytest.fixture
def uri(tmp_path: Path) -> str:
    """A store with steps 1 and 2 (latest) of a small model and its optimizer."""
    uri = str(tmp_path / "store")
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointStore(uri) as store:
        for step in (1, 2):
            state = training_state(model, optimizer)
            state["model"] = {f"model.{k}": v for k, v in model.state_dict().items()}
            store.save(step, state)
    return uri


def _resume(store: CheckpointStore, out: Path) -> object:
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return resume(store, _Prefixed(model), optimizer)


class _Prefixed:
    """The model as the fixture saved it (names under ``model.``)."""

    def __init__(self, model: Linear) -> None:
        self.model = model

    def state_dict(self) -> Any:
        return {f"model.{k}": v for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: Any) -> None:
        self.model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})


def _pull_checkpoint(store: CheckpointStore, out: Path) -> object:
    from ckptstore.integrations.hf_trainer import pull_checkpoint

    return pull_checkpoint(store, out)


def _lightning(store: CheckpointStore, out: Path) -> object:
    from ckptstore.integrations.lightning import StoreCheckpointIO

    return StoreCheckpointIO(store, allow_pickle=True).load_checkpoint("latest")


FACES: dict[str, Callable[[CheckpointStore, Path], object]] = {
    "load": lambda store, out: store.load(),
    "pull_dir": lambda store, out: store.pull_dir(out),
    "resume": _resume,
    "hf pull_checkpoint": _pull_checkpoint,
    "lightning load_checkpoint": _lightning,
    "export_hf": lambda store, out: export_hf(store, None, out),
}
NEEDS = {
    "hf pull_checkpoint": ("transformers", "ckptstore.integrations.hf_trainer"),
    "lightning load_checkpoint": ("lightning", "ckptstore.integrations.lightning"),
}


@pytest.mark.parametrize("face", list(FACES))
def test_each_face_loads_by_the_load_timeout_and_leaves_nothing(
    face: str, uri: str, tmp_path: Path
) -> None:
    for module in NEEDS.get(face, ()):
        pytest.importorskip(module)  # before the clock starts
    load = FACES[face]
    out = tmp_path / "out"
    with slow_store(uri) as store:
        assert_times_out(lambda: load(store, out), 2, uri)
        assert store.backend.unbounded == []  # type: ignore[attr-defined]
    assert everything_under(out) == []
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("store", "out")]
    assert leftovers == []
    with slow_store(uri, timeout=None) as store:
        assert load(store, out) is not None


# -- the CLI's pull, over S3 ----------------------------------------------------------------------


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    started = FaultProxy(s3_endpoint).start()
    yield started
    started.stop()


def test_the_cli_pull_over_s3_runs_by_load_timeout(
    proxy: FaultProxy, s3_uri: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    with CheckpointStore(s3_uri, storage_options=s3_options) as store:
        saved = store.save(3, {"w": torch.arange(1 << 16, dtype=torch.float32)})
    proxy.add_fault(Fault.stall(operations={"GetObject"}, glob="*.attempt-*"))
    creds = ["-o", "stall_timeout=1", "--endpoint-url", proxy.endpoint_url]
    out = tmp_path / "out"
    started = time.monotonic()
    code = run(["pull", s3_uri, str(out), "--load-timeout", "2", "--json", *creds])
    assert time.monotonic() - started < 2 + SLACK
    assert code == 6  # a storage error: the deadline passed
    assert everything_under(tmp_path) == []  # no out/, no temporary directory beside it
    proxy.clear_faults()
    assert run(["pull", s3_uri, str(out), "--json", *creds]) == 0
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == {
        f.path for f in saved.files
    }


# -- verl: the resume's per-node pulls ------------------------------------------------------------


def verl_step(root: Path, step: int) -> Path:
    """What verl writes for ``step`` with two ranks, in one directory."""
    actor = root / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    for rank in range(2):
        for kind in ("model", "optim", "extra_state"):
            (actor / f"{kind}_world_size_2_rank_{rank}.pt").write_bytes(os.urandom(2048))
    (actor / "huggingface" / "config.json").write_text('{"model_type": "llama"}')
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 2}')
    (root / f"global_step_{step}" / "data.pt").write_bytes(b"dataloader")
    return root / f"global_step_{step}"


def verl_config(local_dir: Path, uri: str, **ckptstore: Any) -> dict[str, Any]:
    return {
        "trainer": {
            "default_local_dir": str(local_dir),
            "resume_mode": "auto",
            "resume_from_path": None,
            "nnodes": 2,
            "n_gpus_per_node": 1,
            "ckptstore": {"uri": uri, **ckptstore},
        },
    }


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed")
def test_verl_resume_pulls_on_every_node_by_load_timeout(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    with CheckpointStore(uri) as store:
        store.push_dir(5, verl_step(tmp_path / "saved", 5))
    nodes = [tmp_path / "node0", tmp_path / "node1"]

    def fleet(timeout: float | None) -> LocalFleet:
        agents = {f"n{i}": NodeAgent(str(d), uri, store=slow_store(uri, timeout))
                  for i, d in enumerate(nodes)}  # fmt: skip
        return LocalFleet(agents, driver="n0")

    # the driver's store opens from the config: its load_timeout is the verl key's
    config = verl_config(nodes[0], uri, load_timeout=TIMEOUT)
    assert_times_out(lambda: prepare_resume(config, fleet=fleet(None)), 5, uri)
    for node in nodes:
        assert everything_under(node) in ([], [VERL_TRACKER_NAME]), everything_under(node)
    resumed = prepare_resume(verl_config(nodes[0], uri), fleet=fleet(None))
    assert (resumed.step, resumed.source) == (5, "store")
    for node in nodes:
        assert (node / "global_step_5" / "data.pt").read_bytes() == b"dataloader"


def test_a_node_agent_syncs_by_its_stores_load_timeout(tmp_path: Path) -> None:
    """A Ray actor's pull: the agent's own store (opened with the job's options) sets it."""
    uri = str(tmp_path / "store")
    with CheckpointStore(uri) as store:
        store.push_dir(5, verl_step(tmp_path / "saved", 5))
    node = tmp_path / "node"
    agent = NodeAgent(str(node), uri, store=slow_store(uri))
    assert_times_out(lambda: agent.sync(5), 5, uri)
    assert agent.store.backend.unbounded == []  # type: ignore[attr-defined]
    assert everything_under(node) == []
    agent = NodeAgent(str(node), uri, store=slow_store(uri, timeout=None))
    assert agent.sync(5) is True
    config = json.loads((node / "global_step_5/actor/fsdp_config.json").read_text())
    assert config["world_size"] == 2
