"""The deployment files: terraform/, docker-compose.yml and the Dockerfile.

Checked statically, as CI can (no cloud account, no Docker engine, no provider downloads):
``terraform fmt``, a checkov security scan, the module's structure parsed as HCL (public access,
encryption, TLS, lifecycle, least-privilege IAM), and ``docker compose config``. Each tool check
also runs once on a deliberately broken input, so a check that cannot fail cannot pass.

The tools live in their own virtualenv, made by ``scripts/_tools.sh`` (which ``scripts/test``
sources), and are found through ``CKPTSTORE_TOOLS_BIN``; without them these tests skip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TERRAFORM = ROOT / "terraform"
MODULE = TERRAFORM / "modules" / "ckptstore-bucket"
CHECKOV_CONFIG = TERRAFORM / ".checkov.yaml"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

INSTALL_HINT = (
    "deployment tools not installed: run `source scripts/_tools.sh` (scripts/test does) or set "
    "CKPTSTORE_TOOLS_BIN to a bin/ holding terraform, checkov, compose and a python with hcl2"
)
TIMEOUT = 300

TRAINING_ACTIONS = {
    "s3:ListBucket",
    "s3:ListBucketMultipartUploads",
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "kms:GenerateDataKey",
    "kms:Decrypt",
}
READ_ONLY_ACTIONS = {"s3:ListBucket", "s3:GetObject", "kms:Decrypt"}
RUN_PREFIX_OBJECTS = "/${var.run_prefix}/*"


# -- finding and running the tools -------------------------------------------------------------


@pytest.fixture(scope="module")
def tools() -> Path:
    raw = os.environ.get("CKPTSTORE_TOOLS_BIN")
    if not raw:
        pytest.skip(INSTALL_HINT)
    path = Path(raw)
    missing = [n for n in ("terraform", "checkov", "compose", "python") if not (path / n).exists()]
    if missing:
        pytest.skip(f"{INSTALL_HINT} (missing in {path}: {', '.join(missing)})")
    return path


def run(*command: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CHECKPOINT_DISABLE="1", NO_COLOR="1", ANSI_COLORS_DISABLED="1")
    env.pop("CKPTSTORE_DEMO_RUN", None)  # docker-compose.yml reads it: test the default
    return subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def explain(done: subprocess.CompletedProcess[str]) -> str:
    out, err = done.stdout[-4000:], done.stderr[-4000:]
    return f"exit status {done.returncode}\nstdout:\n{out}\nstderr:\n{err}"


# -- terraform fmt ----------------------------------------------------------------------------


def test_terraform_files_are_formatted(tools: Path) -> None:
    done = run(tools / "terraform", "fmt", "-check", "-recursive", "-diff", "-no-color", TERRAFORM)
    assert done.returncode == 0, f"run `terraform fmt -recursive terraform`\n{explain(done)}"


def test_terraform_fmt_check_fails_on_unformatted_code(tools: Path, tmp_path: Path) -> None:
    (tmp_path / "main.tf").write_text('variable "x" {\ntype=string\n}\n')
    done = run(tools / "terraform", "fmt", "-check", "-recursive", "-no-color", tmp_path)
    assert done.returncode != 0, explain(done)
    assert "main.tf" in done.stdout


# -- checkov ----------------------------------------------------------------------------------


def checkov(tools: Path, directory: Path) -> tuple[subprocess.CompletedProcess[str], Any]:
    done = run(
        tools / "checkov",
        "--directory",
        directory,
        "--config-file",
        CHECKOV_CONFIG,
        "--output",
        "json",
    )
    try:
        report = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"checkov printed no JSON report\n{explain(done)}")
    reports = report if isinstance(report, list) else [report]
    return done, next(r for r in reports if r.get("check_type") == "terraform")


def test_checkov_passes_with_every_skip_explained(tools: Path) -> None:
    done, report = checkov(tools, TERRAFORM)
    summary = report["summary"]
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']})"
        for c in report["results"]["failed_checks"]
    ]
    assert not failed, "checkov failed:\n" + "\n".join(failed)
    assert done.returncode == 0, explain(done)
    assert summary["parsing_errors"] == 0
    assert summary["passed"] >= 100, summary  # it really scanned the module and the example

    # inline skips carry their reason; each skipped id is also listed in .checkov.yaml
    config = CHECKOV_CONFIG.read_text()
    for skipped in report["results"]["skipped_checks"]:
        reason = (skipped.get("check_result") or {}).get("suppress_comment") or ""
        assert len(reason) > 20, f"{skipped['check_id']} on {skipped['resource']}: no reason"
        assert skipped["check_id"] in config, f"{skipped['check_id']} not in .checkov.yaml"

    # directory-wide skips: each id has a comment giving its reason
    listed = re.findall(r"^\s*-\s*(CKV\w+)\s*$", config, flags=re.MULTILINE)
    assert listed, "skip-check list not found in .checkov.yaml"
    for check_id in listed:
        assert re.search(rf"^#\s+{check_id}\s+\S.*", config, flags=re.MULTILINE), check_id


def test_checkov_fails_an_insecure_bucket(tools: Path, tmp_path: Path) -> None:
    (tmp_path / "main.tf").write_text('resource "aws_s3_bucket" "open" {\n  bucket = "open"\n}\n')
    done, report = checkov(tools, tmp_path)
    assert done.returncode != 0, explain(done)
    failed = {c["check_id"] for c in report["results"]["failed_checks"]}
    assert "CKV2_AWS_6" in failed  # no public access block


# -- the module, parsed -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def module(tools: Path) -> dict[str, Any]:
    """Every block of the module's .tf files, by kind, with checkov's HCL parser."""
    script = (
        "import hcl2, json, pathlib, sys\n"
        "out = {}\n"
        "for f in sorted(pathlib.Path(sys.argv[1]).glob('*.tf')):\n"
        "    for kind, blocks in hcl2.load(f.open()).items():\n"
        "        out.setdefault(kind, []).extend(blocks)\n"
        "print(json.dumps(out))\n"
    )
    done = run(tools / "python", "-c", script, MODULE)
    assert done.returncode == 0, explain(done)
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def plain(value: Any) -> Any:
    """The parser wraps each value and block in a one-item list; unwrap those, recursively.

    A one-item HCL list comes out bare too: read list attributes through ``as_list``.
    """
    if isinstance(value, list):
        if len(value) == 1:
            return plain(value[0])
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if not k.startswith("__")}
    return value


def block(module: dict[str, Any], kind: str, type_: str, name: str) -> dict[str, Any]:
    for entry in module.get(kind, []):
        if type_ in entry and name in entry[type_]:
            found: dict[str, Any] = plain(entry[type_][name])
            return found
    raise AssertionError(f"{kind} {type_}.{name} not found in {MODULE}")


def resource(module: dict[str, Any], type_: str, name: str = "this") -> dict[str, Any]:
    return block(module, "resource", type_, name)


def statements(module: dict[str, Any], document: str) -> list[dict[str, Any]]:
    found = block(module, "data", "aws_iam_policy_document", document).get("statement", [])
    return found if isinstance(found, list) else [found]


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def conditions(statement: dict[str, Any]) -> list[dict[str, Any]]:
    return as_list(statement.get("condition", []))


def test_public_access_is_blocked_on_all_four_settings(module: dict[str, Any]) -> None:
    block_ = resource(module, "aws_s3_bucket_public_access_block")
    assert block_["bucket"] == "${aws_s3_bucket.this.id}"
    for setting in (
        "block_public_acls",
        "block_public_policy",
        "ignore_public_acls",
        "restrict_public_buckets",
    ):
        assert block_.get(setting) is True, setting
    ownership = resource(module, "aws_s3_bucket_ownership_controls")
    assert ownership["rule"]["object_ownership"] == "BucketOwnerEnforced"


def test_bucket_is_encrypted_with_a_rotating_key_that_has_a_policy(
    module: dict[str, Any],
) -> None:
    sse = resource(module, "aws_s3_bucket_server_side_encryption_configuration")["rule"]
    default = sse["apply_server_side_encryption_by_default"]
    assert default["sse_algorithm"] == "aws:kms"
    assert default["kms_master_key_id"] == "${aws_kms_key.this.arn}"
    assert sse["bucket_key_enabled"] is True

    key = resource(module, "aws_kms_key")
    assert key["enable_key_rotation"] is True
    assert key["policy"] == "${data.aws_iam_policy_document.key.json}"
    assert statements(module, "key"), "the key policy has no statement"


def test_bucket_policy_denies_requests_without_tls(module: dict[str, Any]) -> None:
    policy = resource(module, "aws_s3_bucket_policy")
    assert policy["policy"] == "${data.aws_iam_policy_document.bucket.json}"
    denies = [
        s
        for s in statements(module, "bucket")
        if s.get("effect") == "Deny"
        and any(
            c["test"] == "Bool"
            and c["variable"] == "aws:SecureTransport"
            and as_list(c["values"]) == ["false"]
            for c in conditions(s)
        )
    ]
    assert len(denies) == 1, "no Deny on aws:SecureTransport = false"
    deny = denies[0]
    assert as_list(deny["actions"]) == ["s3:*"]
    assert set(as_list(deny["resources"])) == {
        "${aws_s3_bucket.this.arn}",
        "${aws_s3_bucket.this.arn}/*",
    }
    assert as_list(deny["principals"]["identifiers"]) == ["*"]


def test_lifecycle_aborts_incomplete_multipart_uploads_after_one_day(
    module: dict[str, Any],
) -> None:
    lifecycle = resource(module, "aws_s3_bucket_lifecycle_configuration")
    rules = [r for r in as_list(lifecycle["rule"]) if r.get("status") == "Enabled"]
    aborting = [r for r in rules if "abort_incomplete_multipart_upload" in r]
    assert len(aborting) == 1
    rule = aborting[0]
    assert rule["abort_incomplete_multipart_upload"]["days_after_initiation"] == 1
    assert rule.get("filter") in ({}, [{}], None), "the rule must cover the whole bucket"


@pytest.fixture(scope="module")
def variables(module: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: plain(spec) for entry in module["variable"] for name, spec in entry.items()}


def test_versioning_is_optional_and_off_by_default(
    module: dict[str, Any], variables: dict[str, dict[str, Any]]
) -> None:
    assert variables["versioning_enabled"]["default"] is False
    versioning = resource(module, "aws_s3_bucket_versioning")
    assert versioning["count"] == "${var.versioning_enabled ? 1 : 0}"

    rule = resource(module, "aws_s3_bucket_lifecycle_configuration")["rule"]
    dynamic = {name: spec for entry in as_list(rule["dynamic"]) for name, spec in entry.items()}
    expire = dynamic["noncurrent_version_expiration"]
    assert expire["for_each"] == "${var.versioning_enabled ? [1] : []}"
    assert expire["content"]["noncurrent_days"] == "${var.noncurrent_version_expiration_days}"


def test_every_variable_is_typed_and_described(variables: dict[str, dict[str, Any]]) -> None:
    for name, spec in variables.items():
        assert spec.get("type"), f"variable {name} has no type"
        assert len(spec.get("description", "")) > 20, f"variable {name} has no description"


def test_training_policy_is_exactly_least_privilege(module: dict[str, Any]) -> None:
    training = statements(module, "training")
    actions = [a for s in training for a in as_list(s["actions"])]
    assert set(actions) == TRAINING_ACTIONS
    assert len(actions) == len(TRAINING_ACTIONS), "an action is granted twice"
    assert not [a for a in actions if "*" in a or "?" in a], "wildcard action"
    assert all(s.get("effect", "Allow") == "Allow" for s in training)
    assert all("not_actions" not in s and "not_resources" not in s for s in training)

    for statement in training:
        granted = set(as_list(statement["actions"]))
        resources = as_list(statement["resources"])
        if granted & {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"}:
            assert granted <= {
                "s3:GetObject",
                "s3:PutObject",
                "s3:DeleteObject",
                "s3:AbortMultipartUpload",
            }
            assert resources == ["${local.objects_arn}"]
        elif granted == {"s3:ListBucket"}:
            assert_listing_is_limited_to_the_run_prefix(module, statement)
        elif granted == {"s3:ListBucketMultipartUploads"}:
            assert resources == ["${aws_s3_bucket.this.arn}"]
        else:
            assert granted == {"kms:GenerateDataKey", "kms:Decrypt"}
            assert_key_used_only_through_s3(statement)

    local_values = {k: plain(v) for entry in module["locals"] for k, v in entry.items()}
    assert local_values["objects_arn"] == "${aws_s3_bucket.this.arn}" + RUN_PREFIX_OBJECTS


def assert_listing_is_limited_to_the_run_prefix(
    module: dict[str, Any], statement: dict[str, Any]
) -> None:
    assert as_list(statement["resources"]) == ["${aws_s3_bucket.this.arn}"]
    (condition,) = conditions(statement)
    assert (condition["test"], condition["variable"]) == ("StringLike", "s3:prefix")
    assert condition["values"] == "${local.list_prefixes}"
    local_values = {k: plain(v) for entry in module["locals"] for k, v in entry.items()}
    assert local_values["list_prefixes"] == ["${var.run_prefix}/", "${var.run_prefix}/*"]


def assert_key_used_only_through_s3(statement: dict[str, Any]) -> None:
    assert as_list(statement["resources"]) == ["${aws_kms_key.this.arn}"]
    (condition,) = conditions(statement)
    assert (condition["test"], condition["variable"]) == ("StringEquals", "kms:ViaService")


def test_read_only_policy_reads_and_nothing_else(module: dict[str, Any]) -> None:
    read_only = statements(module, "read_only")
    actions = [a for s in read_only for a in as_list(s["actions"])]
    assert sorted(actions) == sorted(READ_ONLY_ACTIONS)
    for statement in read_only:
        granted = set(as_list(statement["actions"]))
        if granted == {"s3:ListBucket"}:
            assert_listing_is_limited_to_the_run_prefix(module, statement)
        elif granted == {"s3:GetObject"}:
            assert as_list(statement["resources"]) == ["${local.objects_arn}"]
        else:
            assert granted == {"kms:Decrypt"}
            assert_key_used_only_through_s3(statement)


def test_replication_requires_versioning(module: dict[str, Any]) -> None:
    replication = resource(module, "aws_s3_bucket_replication_configuration")
    assert replication["count"] == "${local.replicate ? 1 : 0}"
    precondition = replication["lifecycle"]["precondition"]
    assert precondition["condition"] == "${var.versioning_enabled}"
    rule = replication["rule"]
    assert rule["filter"]["prefix"] == "${var.run_prefix}/"
    assert rule["source_selection_criteria"]["sse_kms_encrypted_objects"]["status"] == "Enabled"


def test_outputs_give_the_uri_and_storage_options(module: dict[str, Any]) -> None:
    outputs = {name: plain(spec) for entry in module["output"] for name, spec in entry.items()}
    assert outputs["uri"]["value"] == "s3://${aws_s3_bucket.this.id}/${var.run_prefix}"
    assert outputs["storage_options"]["value"] == {"region": "${local.region}"}
    for name in ("training_config", "training_policy_arn", "read_only_policy_arn"):
        assert name in outputs


# -- docker compose ---------------------------------------------------------------------------


def test_compose_file_is_valid(tools: Path) -> None:
    done = run(tools / "compose", "--file", COMPOSE_FILE, "config", "--quiet")
    assert done.returncode == 0, explain(done)


def test_compose_config_fails_on_a_broken_file(tools: Path, tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        "services:\n  trainer:\n    image: ckptstore:demo\n    depends_on: [no-such-service]\n"
    )
    done = run(tools / "compose", "--file", broken, "config", "--quiet", cwd=tmp_path)
    assert done.returncode != 0, explain(done)


@pytest.fixture(scope="module")
def compose(tools: Path) -> dict[str, Any]:
    done = run(tools / "compose", "--file", COMPOSE_FILE, "config", "--format", "json")
    assert done.returncode == 0, explain(done)
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def test_compose_runs_the_demo_against_a_pinned_healthy_minio(compose: dict[str, Any]) -> None:
    services = compose["services"]
    minio = services["minio"]
    assert re.fullmatch(r"[\w./-]+/minio:RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ", minio["image"])
    assert minio["healthcheck"]["test"], "MinIO has no health check"

    create = services["create-bucket"]
    assert create["depends_on"]["minio"]["condition"] == "service_healthy"
    assert "mc mb" in " ".join(create["command"])

    trainer = services["trainer"]
    assert Path(trainer["build"]["context"]) == ROOT
    assert trainer["build"]["dockerfile"] == "Dockerfile"
    assert trainer["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    command = trainer["command"]
    assert command[command.index("--endpoint-url") + 1] == "http://minio:9000"
    assert command[command.index("demo") + 1 : command.index("demo") + 3] == [
        "--uri",
        "s3://ckptstore-demo/tiny-mlp",
    ]
    environment = trainer["environment"]
    assert environment["AWS_ACCESS_KEY_ID"] == minio["environment"]["MINIO_ROOT_USER"]
    assert environment["AWS_SECRET_ACCESS_KEY"] == minio["environment"]["MINIO_ROOT_PASSWORD"]


# -- Dockerfile (static; no Docker engine in CI) ----------------------------------------------


def test_dockerfile_pins_its_base_and_runs_ckptstore_unprivileged() -> None:
    lines = [
        line.strip()
        for line in DOCKERFILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    (base,) = [line for line in lines if line.startswith("FROM ")]
    assert re.fullmatch(r"FROM python:3\.11\.\d+-slim-\w+", base), base
    assert any("download.pytorch.org/whl/cpu" in line for line in lines), "not the CPU torch"
    assert any(re.search(r"pip install \"?\.\[s3\]", line) for line in lines)
    assert any(line.startswith("USER ") and "root" not in line for line in lines)
    assert lines[-2:] == ['ENTRYPOINT ["ckptstore"]', 'CMD ["--help"]']


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[:4] == ["*", "!pyproject.toml", "!README.md", "!src/"]
