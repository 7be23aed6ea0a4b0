"""The package's shape: imports point down the layers docs/design.md draws (import-linter's
contracts in pyproject.toml), and no import hides inside a function to dodge a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "ckptstore"

# What a function may import: modules that are heavy or optional, loaded only when the function
# that needs them runs, so that `import ckptstore` and the CLI start without them. A module of
# ckptstore is here only when importing it imports one of them.
DEFERRED = {
    "torch": "heavy (about a second); the CLI's listing commands never need it",
    "ray": "verl extra; only the per-node agents place actors with it",
    "prometheus_client": "metrics extra",
    "boto3": "s3 extra",
    "botocore": "s3 extra (boto3's)",
    "moto": "demo extra: the embedded S3 server",
    "fsspec": "only for schemes ckptstore does not build in (138 ms to import fsspec.registry)",
    "tqdm": "only when a progress bar is drawn (70 ms to import)",
    "ckptstore.data.serialize": "imports torch",
    "ckptstore.data.snapshot": "imports torch",
    "ckptstore.export.hf": "imports torch",
    "ckptstore.integrations.verl_reshard": "imports torch (its DTensor resharding)",
    "ckptstore.cli.demo": "imports torch and, through the S3 server, moto",
    "ckptstore.backends.s3_errors": "imports botocore (s3 extra)",
    "ckptstore.backends.s3_options": "imports boto3 (s3 extra)",
}


def _imported(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The absolute names ``node`` imports, in ``module`` (for relative imports)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")[: -node.level]
        base = ".".join([*package, base] if base else package)
    # `from ckptstore.export import hf` imports the module ckptstore.export.hf
    return [f"{base}.{a.name}" if _deferred(f"{base}.{a.name}") else base for a in node.names]


def _deferred(name: str) -> bool:
    return any(name == ok or name.startswith(ok + ".") for ok in DEFERRED)


def function_imports(src: Path) -> list[str]:
    """Every import inside a function body under ``src`` that imports something not in
    DEFERRED, as ``path:line: name``."""
    found = []
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src.parent).with_suffix("").parts
        module = ".".join(parts)
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for name in _imported(node, module):
                        if not _deferred(name):
                            rel = path.relative_to(src.parent.parent)
                            found.append(f"{rel}:{node.lineno}: {name}")
    return sorted(set(found))


def test_imports_point_down_the_layers() -> None:
    """lint-imports keeps every contract in pyproject.toml (the layers of docs/design.md)."""
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_no_import_inside_a_function_but_a_deferred_one() -> None:
    """An import in a function body dodges a cycle or hides a layer violation from a reader;
    only heavy or optional modules (DEFERRED, each with its reason) may be imported late."""
    assert function_imports(SRC) == []


def test_the_function_import_check_sees_one(tmp_path: Path) -> None:
    """The check above is not blind: a cycle dodged inside a function is named."""
    package = tmp_path / "src" / "ckptstore" / "tiers"
    package.mkdir(parents=True)
    (package / "local.py").write_text(
        "import torch\n\n\ndef read():\n    from ckptstore.core.resolver import VERIFY_ERRORS\n"
        "    import torch.distributed\n    return VERIFY_ERRORS\n"
    )
    assert function_imports(tmp_path / "src" / "ckptstore") == [
        "src/ckptstore/tiers/local.py:5: ckptstore.core.resolver"
    ]
