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
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
