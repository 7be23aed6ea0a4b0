"""A tiered writer that a test kills while its copies to the bucket are in flight.

``python -m harness.tiersaver URI LOCAL ENDPOINT STEPS``: saves steps 1..STEPS with
``persist_every=1`` (every step due), prints ``saved`` once they are all committed in the local
tier, then waits to be killed. The test stalls the bucket's payload writes first (fault proxy),
so every copy is still in flight when the SIGKILL lands.
"""

from __future__ import annotations

import sys
import time

import torch

from ckptstore import CheckpointStore


def state(step: int) -> dict[str, torch.Tensor]:
    """The state saved as ``step``: recomputable by the test."""
    return {"w": torch.full((1024,), float(step)), "step": torch.tensor(step)}


def main(uri: str, local: str, endpoint: str, steps: int) -> None:
    store = CheckpointStore(
        uri, local=local, persist_every=1, storage_options={"endpoint_url": endpoint}
    )
    for step in range(1, steps + 1):
        store.save(step, state(step))
    print("saved", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
