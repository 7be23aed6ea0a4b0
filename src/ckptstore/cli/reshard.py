"""``ckptstore reshard``: a verl FSDP2 step of a store, rewritten for another world size.

The store's step is never changed: it is pulled (every byte verified) and resharded into a
local directory, or, with ``--commit-as``, committed back as a new step whose metadata records
where it came from (``resharded_from``). torch is imported only when the command runs, so the
other commands keep starting without it.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ckptstore.cli.common import (
    COUNT,
    STEP,
    StepRef,
    common_options,
    emit,
    open_store,
    resolve_step,
)


@click.command("reshard")
@click.argument("uri")
@click.argument("step", type=STEP)
@click.argument("out", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--world-size",
    "-w",
    type=COUNT,
    required=True,
    help="The number of ranks the new files are for (trainer.nnodes x trainer.n_gpus_per_node).",
)
@click.option(
    "--commit-as",
    type=click.IntRange(min=0),
    metavar="STEP",
    help="Commit the resharded step into URI as this step instead of writing OUT.",
)
@click.option(
    "--takeover",
    is_flag=True,
    help="With --commit-as: take the store's writer lease even if another writer holds it.",
)
@common_options
@click.pass_context
def reshard_command(
    ctx: click.Context,
    uri: str,
    step: StepRef,
    out: Path | None,
    world_size: int,
    commit_as: int | None,
    takeover: bool,
) -> None:
    """Reshard verl step STEP of URI (FSDP2, saved on W ranks) for --world-size ranks.

    Writes the new global_step directory to OUT (new or empty), or commits it to URI with
    --commit-as. Model and optimizer shards are exact; rank r's RNG state is old rank r mod W's.
    """
    from ckptstore.integrations.verl_reshard import reshard_from_store

    if (out is None) == (commit_as is None):
        raise click.UsageError("give either OUT or --commit-as STEP (exactly one)")
    store = open_store(ctx, uri, takeover=takeover)
    source = resolve_step(store, step)
    started = time.perf_counter()
    data: dict[str, Any] = {"uri": store.uri, "step": source, "world_size": world_size}
    if out is not None:
        done = reshard_from_store(store, source, out, world_size)
        data |= {"source_world_size": done.source_world_size, "out": str(out)}
        where = str(out)
    else:
        assert commit_as is not None
        metadata = dict(store.info(source).metadata)
        with tempfile.TemporaryDirectory(prefix="ckptstore-reshard-") as tmp:
            done = reshard_from_store(store, source, Path(tmp) / "step", world_size)
            metadata["resharded_from"] = {
                "step": source,
                "world_size": done.source_world_size,
            }
            info = store.push_dir(commit_as, Path(tmp) / "step", metadata)
        data |= {"source_world_size": done.source_world_size, "committed_step": info.step}
        where = f"step {info.step} of {store.uri}"
    data |= {"folders": list(done.folders), "seconds": round(time.perf_counter() - started, 3)}
    emit(
        ctx,
        data,
        f"resharded step {source} of {store.uri} ({', '.join(done.folders)}) from "
        f"{done.source_world_size} to {world_size} ranks into {where} in {data['seconds']:.2f} s",
    )


COMMANDS = [reshard_command]
