"""``ckptstore export`` and ``ckptstore wait``: from a training run's store to a model, as the
run goes.

``export`` writes a committed step's model as a Hugging Face directory, locally or into a
store (ckptstore.export.hf); ``wait`` blocks until a newer step is committed and prints it, so
an evaluation cluster can loop ``wait``, ``export``, load. torch is imported only when export
runs, so the other commands keep starting without it.
"""

from __future__ import annotations

import re
from typing import Any

import click

from ckptstore.cli.common import (
    STEP,
    StepRef,
    common_options,
    emit,
    load_timeout_option,
    open_store,
    parse_pair,
    resolve_step,
    retention_of,
    settings_of,
)
from ckptstore.cli.format import human_size

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


class _SizeType(click.ParamType):  # type: ignore[type-arg]
    """A byte count as ``save_pretrained`` takes it: ``5GB`` (10^9), ``500MiB`` (2^20), ``1024``."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
            self.fail(f"{value!r} is not a size: give 5GB, 500MB, 2GiB or a number of bytes")
        return max(1, int(float(match.group(1)) * _UNITS[unit]))


SIZE = _SizeType()


@click.command("export")
@click.argument("uri")
@click.argument("step", type=STEP)
@click.argument("out")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["hf"]),
    default="hf",
    show_default=True,
    help="Hugging Face: safetensors shards, their index, config and tokenizer files.",
)
@click.option(
    "--role",
    default="actor",
    show_default=True,
    help="The verl role folder whose model is exported (actor, critic); an SFT step's one "
    "model is at its top level and exported by the default.",
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    help="Convert floating-point weights (default: as saved).",
)
@click.option(
    "--shard-size",
    type=SIZE,
    default="5GB",
    show_default=True,
    help="Largest safetensors file (a bigger tensor gets a file of its own).",
)
@click.option(
    "--merge-lora",
    is_flag=True,
    help="Merge a LoRA adapter into the base weights instead of writing it beside them.",
)
@click.option(
    "--key-prefix-map",
    multiple=True,
    metavar="OLD=NEW",
    help="Rename tensors by prefix (repeatable; names no rule matches are left out). "
    "DCP steps default to model.= (the model without the 'model.' prefix).",
)
@click.option(
    "--hf-config",
    type=click.Path(file_okay=False, exists=True),
    help="Directory with config.json and tokenizer files, for steps without huggingface/.",
)
@click.option(
    "--out-option",
    multiple=True,
    metavar="KEY=VALUE",
    help="Storage option for OUT when it is a URI (default: the store's options).",
)
@load_timeout_option
@common_options
@click.pass_context
def export_command(
    ctx: click.Context,
    uri: str,
    step: StepRef,
    out: str,
    fmt: str,
    role: str,
    dtype: str | None,
    shard_size: int,
    merge_lora: bool,
    key_prefix_map: tuple[str, ...],
    hf_config: str | None,
    out_option: tuple[str, ...],
) -> None:
    """Export STEP of URI as a Hugging Face model into OUT (a new directory or a store URI).

    Reads only the model's bytes, in ranged reads (no download of the step), checks every file
    it read against the manifest, and publishes OUT only then. A second export of the same
    step and options to the same OUT is skipped.
    """
    from ckptstore.export.hf import export_hf

    store = open_store(ctx, uri, retention=retention_of(ctx))
    with store.resolver.loading():  # choosing the step and exporting it: one load
        number = resolve_step(store, step)
        options = dict(settings_of(ctx).storage_options)
        options.update(parse_pair(text, "--out-option") for text in out_option)
        report = export_hf(
            store,
            number,
            out,
            role=role,
            dtype=dtype,
            shard_size=shard_size,
            merge_lora=merge_lora,
            key_prefix_map=list(key_prefix_map) or None,
            hf_config=hf_config,
            storage_options=options,
        )
    data = {"uri": store.uri, "format": fmt, **report.record()}
    if report.skipped:
        human = f"step {report.step} of {store.uri} is already exported to {report.out}; skipped"
    else:
        human = (
            f"exported step {report.step} of {store.uri} ({report.kind}, "
            f"{report.world_size} rank(s)) to {report.out}: {report.tensors} tensors, "
            f"{human_size(report.tensor_bytes)} in {len(report.files)} files, "
            f"{report.seconds:.2f} s"
        )
        human += "".join(f"\n  {note}" for note in report.notes)
    emit(ctx, data, human)


@click.command("wait")
@click.argument("uri")
@click.option(
    "--newer-than",
    type=click.IntRange(min=0),
    metavar="STEP",
    help="Wait for a step newer than this one (default: the latest now).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="Give up after this long, with exit status 3 (default: wait forever).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.01),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="The first pause between polls; it grows by half each poll, up to 30 s.",
)
@common_options
@click.pass_context
def wait_command(
    ctx: click.Context, uri: str, newer_than: int | None, timeout: float | None, interval: float
) -> None:
    """Wait until URI has a step newer than --newer-than, then print the newest such step.

    Polls with one listing each time, backing off from --interval to 30 s. For a loop
    on an evaluation cluster: STEP=$(ckptstore wait URI --newer-than $STEP) && ckptstore
    export URI $STEP ./model-$STEP
    """
    store = open_store(ctx, uri)
    info = store.wait_for_step(newer_than, timeout=timeout, interval=interval)
    emit(
        ctx,
        {"uri": store.uri, "step": info.step, "created": info.time, "size": info.size},
        str(info.step),
    )


COMMANDS = [export_command, wait_command]
