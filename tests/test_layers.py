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
    "ckptstore.tiers.peers": "imports torch.distributed (peer copies over gloo)",
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


# -- faces use the store's public surface ----------------------------------------------------

FACES = ("cli", "integrations", "export")


def _is_store(node: ast.expr, stores: set[str]) -> bool:
    """``store``, ``self.store``, ``dest_store``, or a name annotated ``CheckpointStore``."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name in stores or (name.lstrip("_").endswith("store") and name != "ckptstore")


def _chain(node: ast.Attribute) -> tuple[ast.expr, list[str]]:
    """``a.b.c.d`` as its innermost expression (``a``) and the attributes after it."""
    names: list[str] = []
    inner: ast.expr = node
    while isinstance(inner, ast.Attribute):
        names.append(inner.attr)
        inner = inner.value
    return inner, names[::-1]


def _deep(chain_root: ast.expr, names: list[str], stores: set[str]) -> list[str] | None:
    """The attributes walked past a store in this chain, if any store is in it."""
    parts: list[ast.expr] = [chain_root]
    for name in names:
        parts.append(ast.Attribute(value=parts[-1], attr=name))
    for i in range(len(parts) - 1, -1, -1):  # the last store in the chain (self.store.x)
        if _is_store(parts[i], stores):
            return names[i:]
    return None


def _walked(
    node: ast.Attribute, stores: set[str], engines: dict[str, list[str]]
) -> list[str] | None:
    """The attributes this chain walks past a store, counting those of a name bound to one."""
    root, names = _chain(node)
    walked = _deep(root, names, stores)
    if walked is None and isinstance(root, ast.Name) and root.id in engines:
        walked = [*engines[root.id], *names]
    return walked


def reaches_into_engines(src: Path) -> list[str]:
    """Every place a face walks more than one attribute past a store (``store.tiers.node.x``,
    also through a name bound to ``store.tiers``), or touches a private one (``store._x``)."""
    found = []
    for path in sorted(p for face in FACES for p in (src / face).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        stores = {
            a.arg
            for a in ast.walk(tree)
            if isinstance(a, ast.arg) and "CheckpointStore" in ast.unparse(a.annotation or a)
        }
        # names bound to a walk past a store (tiers = store.tiers; node = tiers.node), with
        # the attributes walked so far, found to a fixed point (bindings of bindings)
        engines: dict[str, list[str]] = {}
        for _ in range(3):
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
                    walked = _walked(node.value, stores, engines)
                    if walked:
                        engines |= {t.id: walked for t in node.targets if isinstance(t, ast.Name)}
        outer = {
            id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
        }  # inner links of a longer chain: the whole chain is judged once
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in outer:
                continue
            walked = _walked(node, stores, engines)
            if not walked:  # no store here, or the store itself (self.store)
                continue
            if len(walked) > 2 or walked[0].startswith("_"):
                rel = path.relative_to(src.parent.parent)
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_faces_walk_at_most_one_attribute_into_the_engines() -> None:
    """A face calls the store or one of the engines it shows (``store.resolver.loading()``,
    ``store.tiers.join(m)``), never their parts (``store.tiers.node.local.remover``): what a
    face needs of them is a method there (tiers/persister.py's face section)."""
    assert reaches_into_engines(SRC) == []


def test_the_face_check_sees_a_deep_walk(tmp_path: Path) -> None:
    """The check above is not blind: a walk into the tiers' parts, directly, through a name
    bound to an engine, or into a private attribute, is named; the store's surface is not."""
    face = tmp_path / "src" / "ckptstore" / "integrations"
    face.mkdir(parents=True)
    (face / "x.py").write_text(
        "def f(store, s: CheckpointStore):\n"
        "    store.tiers.node.join(1)\n"
        "    tiers = store.tiers\n"
        "    tiers.node.hold(2)\n"
        "    s._catalog.scan()\n"
        "    store.resolver.loading()\n"
        "    tiers.join(3)\n"
        "    node = tiers.node\n"
        "    node.join(4)\n"
        "    return self.store.tiers.share_last()\n"
    )
    assert reaches_into_engines(tmp_path / "src" / "ckptstore") == [
        "src/ckptstore/integrations/x.py:2: store.tiers.node.join",
        "src/ckptstore/integrations/x.py:4: tiers.node.hold",
        "src/ckptstore/integrations/x.py:5: s._catalog.scan",
        "src/ckptstore/integrations/x.py:9: node.join",
    ]
