# Sourced by scripts/demo, scripts/test and scripts/test-fast: make .venv (once) and install the
# project into it, saying so first. Everything stays in the checkout: .venv/, pip's cache and the
# simulated driver in .cache/. A caller that runs the tests sets `for_tests=1` before sourcing:
# then the dev tools and torch (the CPU tier's tensor tests) come too, which the demo needs not.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$root/.cache/pip}"
# the simulated driver is built inside the checkout (gitignored), not in ~/.cache
export GPU_SERDE_CACHE_DIR="${GPU_SERDE_CACHE_DIR:-$root/.cache/gpu_serde}"
if [ "${for_tests:-0}" = 1 ]; then
  extras="all,dev"
  stamp="$venv/.gpu_serde-installed-for-tests"
else
  extras="all"
  stamp="$venv/.gpu_serde-installed"
fi
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  with_torch=0  # torch's CPU build for the tests, on Python 3.11 (see below)
  py="$venv/bin/python"
  [ -x "$py" ] || py="${PYTHON:-python3}"
  if [ "$extras" != all ] && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    with_torch=1
  fi
  echo "gpu_serde: setting up $venv (once): pip installs gpu_serde[$extras]" \
    "$([ $with_torch = 0 ] || echo "and torch's CPU build ")into it; nothing outside the checkout" >&2
  if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"  # PYTHON=python3.10 scripts/test: another interpreter
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$root[$extras]"
  # torch for the CPU tier's tensor tests (tests/test_tensors.py), on Python 3.11 only: its CPU
  # build (PyPI's plain "torch" is a CUDA build of several GB). From the package index pip is
  # set up with where that has it (a local mirror), else from PyTorch's own CPU index. The other
  # Pythons (the version matrix) skip those tests, saying why.
  if [ $with_torch = 1 ]; then
    "$venv/bin/python" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null ||
      "$venv/bin/python" -m pip install -q "torch==2.13.0+cpu" \
        --extra-index-url https://download.pytorch.org/whl/cpu
  fi
  touch "$stamp"
  [ "$extras" = all ] || touch "$venv/.gpu_serde-installed"  # what the demo needs is there too
fi
export PATH="$venv/bin:$PATH"
cd "$root"

# loopback_only COMMAND...: run COMMAND in a network namespace of its own whose one interface is
# loopback (as root, or through an unprivileged user namespace): the tests' clusters can then
# listen nowhere else, also Ray's `ray start` nodes, whose servers listen on every interface of a
# node address other than 127.0.0.1. Where no namespace can be made, COMMAND runs here, saying so.
loopback_only() {
  local how=()
  if command -v ip > /dev/null && unshare --net true 2> /dev/null; then
    how=(unshare --net --)
  elif command -v ip > /dev/null && unshare --user --map-root-user --net true 2> /dev/null; then
    how=(unshare --user --map-root-user --net --)
  else
    echo "gpu_serde: no network namespace can be made here (unshare, ip): the tests run in this" \
      "one, where Ray's CLI nodes (integration/) also listen beyond loopback" >&2
    "$@"
    return
  fi
  "${how[@]}" sh -c 'ip link set lo up && exec "$@"' sh "$@"
}
