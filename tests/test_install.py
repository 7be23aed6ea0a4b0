"""The extras in pyproject.toml install only what their part of the project uses (issue 28).

Each extra names only packages that some module of its area imports (s3fs, which only the
benchmarks use, is in `bench`, not in `s3` or `demo`), and the `test` extra brings every
third-party module that the suite imports, plus the tools scripts/test runs. Reads files only:
no network, no install. scripts/check-install (run by .ci/run) checks the install itself.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10, where pytest brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "ckptstore"

# Where each extra is used: the files (or folders) whose imports justify its packages.
AREAS: dict[str, tuple[str, ...]] = {
    # the s3:// backend and the `ckptstore bucket` commands
    "s3": ("src/ckptstore/backends", "src/ckptstore/cli"),
    # `ckptstore demo` and the local S3 server it starts
    "demo": ("src/ckptstore/cli/demo.py", "src/ckptstore/testing/s3server.py"),
    # verl imports ckptstore's callback, not the other way round: its tests import verl
    "verl": ("src/ckptstore/integrations", "tests"),
    "metrics": ("src/ckptstore/integrations/prometheus.py",),
    "lightning": ("src/ckptstore/integrations/lightning.py",),
    # the Trainer integration; its test declares accelerate, which the Trainer itself needs
    "transformers": ("src/ckptstore/integrations/hf_trainer.py", "tests/test_hf_trainer.py"),
    "bench": ("benchmarks",),
}

# The top-level modules a distribution provides, where that is not its own name.
PROVIDES: dict[str, frozenset[str]] = {
    "boto3": frozenset({"boto3", "botocore"}),  # boto3 pins botocore to its own release
    "prometheus-client": frozenset({"prometheus_client"}),
}

# Modules the suite imports that come with a dependency of the test extra rather than by name.
BROUGHT_BY: dict[str, str] = {
    "botocore": "boto3",
    "urllib3": "boto3",  # through botocore, which pins its range
    "tokenizers": "transformers",
    "ray": "verl",
    "omegaconf": "verl",  # through hydra-core
    "hydra": "verl",  # hydra-core
    "peft": "verl",
    "torchdata": "verl",
    "pandas": "verl",  # the SFT test writes its parquet data with it
    "packaging": "pytest",
    "tomli": "pytest",  # on Python < 3.11, where tomllib is missing
}

# Packages of the test extra that are run rather than imported: (file, text that runs it).
TOOLS: dict[str, tuple[str, str]] = {
    "ruff": ("scripts/test", "ruff check"),
    "mypy": ("scripts/test", "\nmypy"),
    "import-linter": ("scripts/test", "\nlint-imports"),
    "pytest-xdist": ("scripts/test", "pytest -n"),
    "pytest-timeout": ("pyproject.toml", "\ntimeout = "),
}


@cache
def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        data: dict[str, Any] = tomllib.load(f)
    return data


def extras() -> dict[str, list[Requirement]]:
    table = pyproject()["project"]["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in table.items()}


def modules_of(dist: str) -> frozenset[str]:
    name = canonicalize_name(dist)
    return PROVIDES.get(name, frozenset({name.replace("-", "_")}))


def python_files(paths: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for rel in paths:
        path = ROOT / rel
        assert path.exists(), f"{rel} does not exist: update AREAS in {Path(__file__).name}"
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return [f for f in files if ".egg-info" not in str(f)]


@cache
def imports_of(path: Path) -> frozenset[str]:
    """Top-level modules ``path`` imports, anywhere in it, or asks for by pytest.importorskip."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value.split(".")[0])
    return frozenset(found)


def imported_in(paths: Iterable[str]) -> set[str]:
    return set().union(*(imports_of(f) for f in python_files(paths)))


def test_every_extra_has_an_area() -> None:
    assert set(extras()) - {"test"} == set(AREAS), (
        "each extra needs an entry in AREAS (and AREAS none for a removed extra)"
    )


@pytest.mark.parametrize("extra", sorted(AREAS))
def test_extra_names_only_what_its_area_imports(extra: str) -> None:
    used = imported_in(AREAS[extra])
    unused = [
        str(req)
        for req in extras()[extra]
        if canonicalize_name(req.name) != PROJECT and not modules_of(req.name) & used
    ]
    assert not unused, f"ckptstore[{extra}] names {unused}, which nothing in {AREAS[extra]} imports"


def test_s3fs_only_in_the_bench_extra() -> None:
    """The issue itself: s3fs (and through it aiobotocore's botocore cap) is for benchmarks."""
    with_s3fs = {name for name, reqs in extras().items() if any(r.name == "s3fs" for r in reqs)}
    assert with_s3fs == {"bench"}
    assert "s3fs" in imported_in(["benchmarks"])
    assert "s3fs" not in imported_in(["src"])


def _test_extra_dists() -> set[str]:
    """Distributions the test extra names, its own extras expanded, plus the core ones."""
    table = extras()
    dists = {canonicalize_name(Requirement(r).name) for r in pyproject()["project"]["dependencies"]}
    todo, seen = ["test"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for req in table[extra]:
            if canonicalize_name(req.name) == PROJECT:
                todo.extend(sorted(req.extras - seen))
            else:
                dists.add(canonicalize_name(req.name))
    return dists


def test_test_extra_brings_what_the_suite_imports() -> None:
    dists = _test_extra_dists()
    provided = set().union(*(modules_of(d) for d in dists))
    provided |= {module for module, dist in BROUGHT_BY.items() if dist in dists}
    local = {p.stem for d in ("tests", "benchmarks") for p in (ROOT / d).rglob("*.py")}
    local |= {p.name for p in (ROOT / "tests").iterdir() if p.is_dir()} | {PROJECT}
    third_party = imported_in(["tests"]) - set(sys.stdlib_module_names) - local
    missing = sorted(third_party - provided)
    assert not missing, f"the suite imports {missing}, which ckptstore[test] does not install"


def test_test_extra_tools_are_used() -> None:
    imported = imported_in(["tests"])
    for req in extras()["test"]:
        name = canonicalize_name(req.name)
        if name == PROJECT or modules_of(name) & imported:
            continue
        assert name in TOOLS, f"ckptstore[test] names {req}: the suite neither imports nor runs it"
        file, text = TOOLS[name]
        assert text in (ROOT / file).read_text(), f"{file} no longer runs {name} ({text.strip()!r})"
