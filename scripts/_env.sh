# Sourced by scripts/demo and scripts/test: make .venv and install ckptstore into it.
# Re-installs only when pyproject.toml changed since the last install.
# CKPTSTORE_NEWEST=1 (scripts/test --newest): .venv-newest instead, with the newest torch, boto3
# and everything else the index offers and the extras allow, re-resolved once a day.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
newest="${CKPTSTORE_NEWEST:-}"
venv="$root/.venv${newest:+-newest}"
# The pinned venv also takes `bench` (s3fs, s3torchconnector: the benchmark smoke runs compare
# with them); the newest leaves it out, since s3fs's aiobotocore caps botocore below the newest.
default_extras="test,bench"
if [ -n "$newest" ]; then default_extras="test"; fi
extras="${CKPTSTORE_EXTRAS:-$default_extras}"
stamp="$venv/.installed-$extras"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv "$venv"
fi
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)${newest:+ $(date +%F)}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing ckptstore[$extras] into $venv (first run takes a few minutes)" >&2
  # --no-cache-dir: the install is several GB; a second copy in pip's cache can fill a small disk.
  "$venv/bin/python" -m pip install -q --no-cache-dir --upgrade pip >&2
  # Pin the CPU build of torch in the same resolve: alone, `torch>=2.1` may be "upgraded" to a
  # multi-GB CUDA build even with 2.13.0 already installed. (The boto3 cap that keeps pip from
  # backtracking under s3fs's aiobotocore lives with s3fs, in pyproject.toml's `bench` extra,
  # which the `test` extra leaves out.) The newest venv takes whatever torch the index offers.
  if [ -n "$newest" ]; then
    "$venv/bin/python" -m pip install -q --no-cache-dir --upgrade --upgrade-strategy eager \
      torch boto3 -e "$root[$extras]" >&2
  else
    "$venv/bin/python" -m pip install -q --no-cache-dir "torch==${CKPTSTORE_TORCH:-2.13.0}" \
      -e "$root[$extras]" >&2
  fi
  "$venv/bin/python" -m pip list 2>/dev/null | grep -E '^(torch|boto3) ' | sed 's/^/setup: /' >&2 || true
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
