"""``ckptstore mb``: create the bucket of an ``s3://`` URI, so trying ckptstore on moto or MinIO
needs no aws CLI and no web console.

Real deployments create buckets with Terraform (``terraform/``), which also sets encryption,
lifecycle and IAM; this command is for local servers and quick experiments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ckptstore.backends.registry import scheme_of
from ckptstore.cli.common import common_options, emit, settings_of
from ckptstore.errors import ConfigError


@click.command("mb")
@click.argument("uri")
@common_options
@click.pass_context
def mb_command(ctx: click.Context, uri: str) -> None:
    """Create the bucket of an s3:// URI (a no-op if you already own it).

    For local paths, create the directory.
    """
    if scheme_of(uri) == "file":
        created = _make_dir(uri)
        emit(ctx, {"uri": uri, "created": created}, f"{'created' if created else 'exists'}: {uri}")
        return
    if scheme_of(uri) != "s3":
        raise ConfigError(
            f"{uri}: mb creates S3 buckets and local directories; create a bucket of another "
            "service with its own tools",
            uri=uri,
        )
    bucket, created, region = _make_bucket(uri, dict(settings_of(ctx).storage_options))
    data = {"uri": f"s3://{bucket}", "created": created, "region": region}
    emit(
        ctx,
        data,
        f"created bucket s3://{bucket}" if created else f"bucket s3://{bucket} already exists",
    )


def _make_dir(uri: str) -> bool:
    path = Path(uri.removeprefix("file://")).expanduser()
    if path.is_dir():
        return False
    try:
        path.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(f"cannot create directory {path}: {e.strerror}", uri=uri) from e
    return True


def _make_bucket(uri: str, options: dict[str, Any]) -> tuple[str, bool, str]:
    """Create the bucket; ``(bucket, created, region)``. Owning it already is not an error."""
    from botocore.exceptions import BotoCoreError, ClientError

    from ckptstore.backends.s3_errors import code_of, is_not_found, translate
    from ckptstore.backends.s3_options import S3Options, parse_s3_uri

    bucket, _ = parse_s3_uri(uri)
    client = S3Options.parse(uri, options).client(uri)
    region = str(client.meta.region_name or "us-east-1")
    request: dict[str, Any] = {"Bucket": bucket}
    if region != "us-east-1":  # S3 refuses an explicit us-east-1 constraint
        request["CreateBucketConfiguration"] = {"LocationConstraint": region}

    def failed(e: Exception, action: str) -> Exception:
        endpoint = client.meta.endpoint_url
        return translate(e, bucket=bucket, endpoint=endpoint, target=uri, action=action)

    try:
        # us-east-1 answers 200 to creating a bucket one owns already: ask first
        client.head_bucket(Bucket=bucket)
        return bucket, False, region
    except ClientError as e:
        if not is_not_found(e):
            raise failed(e, "check") from e
    except BotoCoreError as e:
        raise failed(e, "check") from e
    try:
        client.create_bucket(**request)
    except ClientError as e:
        if code_of(e) == "BucketAlreadyOwnedByYou":
            return bucket, False, region
        raise failed(e, "create") from e
    except BotoCoreError as e:
        raise failed(e, "create") from e
    return bucket, True, region


COMMANDS = [mb_command]
