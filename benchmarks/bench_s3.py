"""The S3 rows: the ways people save a ``state_dict`` to S3 today (limits: bench_s3_limits).

Each library is used the way its documentation shows, with its own defaults except where a row
says it is tuned.
"""

from __future__ import annotations

import io
from typing import IO, Any, cast

import torch
from bench_methods import Method, Spec, materialize

MiB = 1 << 20


def boto_client(spec: Spec, *, checksums: bool = True, pool: int = 0) -> Any:
    import boto3
    from botocore.config import Config

    s3 = _s3(spec)
    config = Config(
        max_pool_connections=max(pool, 2 * spec.concurrency + 2, 10),
        request_checksum_calculation="when_supported" if checksums else "when_required",
        response_checksum_validation="when_supported" if checksums else "when_required",
    )
    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        region_name=s3.region,
        aws_access_key_id=s3.key,
        aws_secret_access_key=s3.secret,
        config=config,
    )


def transfer_config(part_size: int, concurrency: int) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=part_size,
        multipart_chunksize=part_size,
        max_concurrency=concurrency,
        use_threads=True,
    )


def _s3(spec: Spec) -> Any:
    if spec.s3 is None:
        raise ValueError(f"{spec.row} needs an S3 target")
    return spec.s3


class _Boto(Method):
    client: Any

    def key(self, name: str) -> str:
        return f"{_s3(self.spec).prefix}/{name}"

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=_s3(self.spec).bucket, Key=self.key(name))


class BotoSave(_Boto):
    """``torch.save`` into a ``BytesIO``, then ``upload_fileobj`` with a tuned TransferConfig."""

    def setup(self, state: Any) -> None:
        self.client = boto_client(self.spec)
        self.config = transfer_config(self.spec.part_size, self.spec.concurrency)
        super().setup(state)

    def before(self, i: int, state: Any) -> None:
        super().before(i, state)
        if self.kind == "save":
            self.delete("state.pt")

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self.write(state)
        return None, {}

    def write(self, state: Any) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        bucket, key = _s3(self.spec).bucket, self.key("state.pt")
        self.client.upload_fileobj(buffer, bucket, key, Config=self.config)


class BotoLoad(BotoSave):
    kind = "load"

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        buffer = io.BytesIO()
        bucket, key = _s3(self.spec).bucket, self.key("state.pt")
        self.client.download_fileobj(bucket, key, buffer, Config=self.config)
        buffer.seek(0)
        return torch.load(buffer, map_location="cpu"), {}


def fsspec_options(spec: Spec) -> dict[str, Any]:
    s3 = _s3(spec)
    opts: dict[str, Any] = {"client_kwargs": {"region_name": s3.region}}
    opts |= {"endpoint_url": s3.endpoint_url} if s3.endpoint_url else {}
    opts |= {"key": s3.key, "secret": s3.secret} if s3.key and s3.secret else {}
    return opts


class S3fsSave(Method):
    """``torch.save`` into ``s3fs.open(path, "wb")``: the path DCP's FsspecWriter takes."""

    def setup(self, state: Any) -> None:
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **fsspec_options(self.spec))
        s3 = _s3(self.spec)
        self.path = f"{s3.bucket}/{s3.prefix}/state.pt"
        super().setup(state)

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self.write(state)
        return None, {}

    def write(self, state: Any) -> None:
        with self.fs.open(self.path, "wb") as f:
            torch.save(state, f)


class S3fsLoad(S3fsSave):
    kind = "load"

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        with self.fs.open(self.path, "rb") as f:
            return torch.load(f, map_location="cpu"), {}


class DcpFsspecSave(Method):
    """``torch.distributed.checkpoint.save`` with ``FsspecWriter`` on ``s3://`` (s3fs)."""

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self.write(state, f"dcp-{i}")
        return None, {}

    def write(self, state: Any, name: str = "dcp") -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        writer = FsspecWriter(_s3(self.spec).uri(name), **fsspec_options(self.spec))
        save(state, storage_writer=writer)


class DcpFsspecLoad(DcpFsspecSave):
    kind = "load"

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.state_dict_loader import load

        out = materialize(self.skeleton)
        reader = FsspecReader(_s3(self.spec).uri("dcp"), **fsspec_options(self.spec))
        load(out, storage_reader=reader)
        return out, {}


class S3tcSave(Method):
    """s3torchconnector's ``S3Checkpoint`` (AWS CRT client) with its default settings."""

    def setup(self, state: Any) -> None:
        try:
            from s3torchconnector import S3Checkpoint, S3ClientConfig
        except ImportError as e:
            raise RuntimeError(
                "s3torchconnector is not installed (pip install s3torchconnector==1.5.0)"
            ) from e
        s3 = _s3(self.spec)
        config = S3ClientConfig(force_path_style=bool(s3.endpoint_url))
        self.checkpoint = S3Checkpoint(s3.region, s3.endpoint_url, s3client_config=config)
        super().setup(state)

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        self.write(state)
        return None, {}

    def write(self, state: Any) -> None:
        with self.checkpoint.writer(_s3(self.spec).uri("state.pt")) as writer:
            torch.save(state, writer)


class S3tcLoad(S3tcSave):
    kind = "load"

    def run(self, i: int, state: Any) -> tuple[Any, dict[str, float]]:
        with self.checkpoint.reader(_s3(self.spec).uri("state.pt")) as reader:
            return torch.load(cast(IO[bytes], reader), map_location="cpu"), {}
