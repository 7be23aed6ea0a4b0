# ckptstore's command line in a container, CPU only. The trainer of docker-compose.yml runs
# `ckptstore demo` with it; any other command works too:
#   docker build -t ckptstore . && docker run --rm ckptstore ls s3://bucket/run -o region=...
FROM python:3.11.13-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

# Then ckptstore with the S3 extra (boto3); the torch above satisfies its torch requirement.
WORKDIR /build
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ".[s3]" && cd / && rm -rf /build

RUN useradd --create-home --uid 10001 ckptstore
USER ckptstore
WORKDIR /home/ckptstore

ENTRYPOINT ["ckptstore"]
CMD ["--help"]
