"""Export a committed step as a model others load: ``export_hf(store, step, out)``.

Modules by concern: where a format keeps its tensors (verl_source, dcp_source, native_source,
archives, found), the plain plan of what is written (plan, lora), the model named and written
file by file (writer), the bytes produced from ranged reads (source, stream), the check of
every file read (ledger), where the export goes (target) and its record beside the step
(records); hf.py runs them in order and publishes. ``export_hf`` and
``ExportReport`` are imported lazily, so that reading export records (the CLI's ``ls``) does
not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptstore.export.hf import ExportReport, export_hf


def __getattr__(name: str) -> Any:
    if name in ("export_hf", "ExportReport"):
        from ckptstore.export import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ExportReport", "export_hf"]
