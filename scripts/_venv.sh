# Sourced by scripts/demo and scripts/test: make .venv (once) and install the project into it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.gpu_serde-installed"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"  # PYTHON=python3.10 scripts/test: another interpreter
fi
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$root[all,dev]"
  # torch for the CPU tier's tensor tests (tests/test_tensors.py), on Python 3.11 only: there the
  # package index has this CPU build; any other spelling or Python pulls a CUDA build of several
  # GB. The other Pythons (the version matrix) skip those tests, saying why.
  if "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    "$venv/bin/python" -m pip install -q "torch==2.13.0"
  fi
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
