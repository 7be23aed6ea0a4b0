"""verl's LoRA steps: the base model, the adapter PEFT loads, or the two merged.

With LoRA, verl's actor is a PEFT model, and FSDP2 saves its ``state_dict()``: PEFT's names
(``base_model.model.<module>.base_layer.weight`` for a wrapped layer's frozen weight,
``base_model.model.<module>.lora_A.<adapter>.weight`` and ``lora_B`` for the adapter), beside
``lora_train_meta.json`` with ``r``, ``lora_alpha`` and ``task_type``. With
``checkpoint.save_lora_only`` only the adapter is saved.

An export writes the base model under Hugging Face's names (``base_model.model.`` and
``.base_layer`` dropped) and the adapter as PEFT saves one (``lora_adapter/``:
``adapter_config.json`` and ``adapter_model.safetensors``, keys without the adapter name), as
verl's ``model_merger`` lays it out. With ``merge_lora`` each wrapped weight becomes
``W + (lora_alpha / r) * B @ A``, PEFT's ``merge_and_unload`` for a plain LoRA layer, computed
in float32 and cast back to the weight's dtype; only the merged model is written. Without
``lora_alpha`` the scale is unknown, and merging is refused rather than guessed (verl's merger
falls back to ``lora_alpha=0``, which merges nothing).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import CompatibilityError, ConfigError
from ckptstore.export.plan import Merged, Source, SourceTensor

ADAPTER_DIR = "lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
_OTHER_LORA = re.compile(r"\.lora_(embedding_[AB]|magnitude_vector)\.|\.lora_[AB]\.[^.]+\.bias$")


@dataclass(frozen=True)
class LoraSplit:
    """The model's tensors under Hugging Face names, and the adapter's under PEFT's."""

    model: list[tuple[str, Source]]
    adapter: list[tuple[str, SourceTensor]]
    config: dict[str, Any]
    merged: int


def has_lora(names: Sequence[str]) -> bool:
    return any(_LORA.match(n) or _OTHER_LORA.search(n) for n in names)


def split_lora(
    tensors: Sequence[SourceTensor], meta: Mapping[str, Any] | None, *, merge: bool, where: str
) -> LoraSplit:
    """Separate a PEFT state into the base model and the adapter (or merge them)."""
    unsupported = [t.name for t in tensors if _OTHER_LORA.search(t.name)]
    if unsupported:
        raise CompatibilityError(
            f"{where}: {unsupported[0]} is a LoRA tensor of a kind an export does not handle "
            "(embedding LoRA, DoRA or LoRA biases); only linear LoRA layers are supported"
        )
    by_name = {t.name: t for t in tensors}
    pairs: dict[str, dict[str, SourceTensor]] = {}
    adapters: set[str] = set()
    for tensor in tensors:
        match = _LORA.match(tensor.name)
        if match:
            pairs.setdefault(match["module"], {})[match["ab"]] = tensor
            adapters.add(match["adapter"])
    if len(adapters) > 1:
        raise CompatibilityError(
            f"{where}: LoRA adapters {sorted(adapters)}; an export handles one adapter"
        )
    rank = _rank(pairs, where)
    config = adapter_config(meta, rank, sorted({m.rsplit(".", 1)[-1] for m in pairs}), where)
    adapter = [
        (f"{module}.lora_{ab}.weight", ab_tensors[ab])
        for module, ab_tensors in pairs.items()
        for ab in ("A", "B")
    ]
    lora_names = {t.name for _, t in adapter}
    bases = {f"{module}.base_layer.weight": module for module in pairs}
    if merge:
        missing = [b for b in bases if b not in by_name]
        if missing:
            raise ConfigError(
                f"{where}: the step holds the LoRA adapter without the base weights it adapts "
                f"({missing[0]} is missing: verl saved it with checkpoint.save_lora_only); "
                "export the adapter (without --merge-lora) and merge it into the base model it "
                "was trained from"
            )
        if not config.get("lora_alpha"):
            raise ConfigError(
                f"{where}: lora_train_meta.json gives no lora_alpha, so the LoRA scale "
                "(lora_alpha / r) is unknown and a merge would be wrong; export the adapter "
                "without --merge-lora and merge it where the training config is known"
            )
    scale = float(config.get("lora_alpha") or 0) / rank
    model: list[tuple[str, Source]] = []
    for tensor in tensors:
        if tensor.name in lora_names:
            continue
        name = hf_name(tensor.name)
        module = bases.get(tensor.name)
        if merge and module is not None:
            ab = pairs[module]
            model.append((name, Merged(name, tensor, ab["A"], ab["B"], scale)))
        else:
            model.append((name, tensor))
    return LoraSplit(model, [] if merge else adapter, config, len(pairs) if merge else 0)


def hf_name(name: str) -> str:
    """PEFT's name of a base-model tensor -> the plain model's."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_config(
    meta: Mapping[str, Any] | None, rank: int, targets: list[str], where: str
) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for a plain LoRA adapter, from verl's training meta."""
    meta = meta or {}
    r = int(meta.get("r") or rank)
    if r != rank:
        raise CompatibilityError(
            f"{where}: lora_train_meta.json says r={r}, the adapter's matrices have rank {rank}"
        )
    alpha = meta.get("lora_alpha")
    return {
        "peft_type": "LORA",
        "task_type": str(meta.get("task_type") or "CAUSAL_LM"),
        "r": r,
        "lora_alpha": alpha,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }


def _rank(pairs: Mapping[str, Mapping[str, SourceTensor]], where: str) -> int:
    ranks = set()
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise CompatibilityError(f"{where}: {module} has lora_{''.join(ab)} only")
        a, b = ab["A"].shape, ab["B"].shape
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise CompatibilityError(f"{where}: {module}: lora_A {a} and lora_B {b} do not pair")
        ranks.add(a[0])
    if len(ranks) != 1:
        raise CompatibilityError(f"{where}: LoRA ranks differ between layers ({sorted(ranks)})")
    return ranks.pop()


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS",
    "LoraSplit",
    "adapter_config",
    "has_lora",
    "hf_name",
    "split_lora",
]
