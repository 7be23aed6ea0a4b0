# Sourced by scripts/demo and scripts/test: make .venv and install ckptstore into it.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extras="${CKPTSTORE_EXTRAS:-test}"
stamp="$venv/.installed-$extras"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv "$venv"
fi
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing ckptstore[$extras] into $venv (first run takes a few minutes)" >&2
  # --no-cache-dir: the install is several GB; a second copy in pip's cache can fill a small disk.
  "$venv/bin/python" -m pip install -q --no-cache-dir --upgrade pip >&2
  # Pin the CPU build of torch in the same resolve: alone, `torch>=2.1` may be "upgraded" to a
  # multi-GB CUDA build even with 2.13.0 already installed. (The boto3 cap that keeps pip from
  # backtracking under s3fs's aiobotocore lives with s3fs, in pyproject.toml's `bench` extra.)
  "$venv/bin/python" -m pip install -q --no-cache-dir "torch==${CKPTSTORE_TORCH:-2.13.0}" \
    -e "$root[$extras]" >&2
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
