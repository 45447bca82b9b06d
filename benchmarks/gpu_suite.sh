#!/usr/bin/env bash
# `orbax-mtc bench suite` with the state on one GPU, one process. (One GPU per process: NCCL
# does not put two ranks on one GPU, so the multi-process rows need a host with more GPUs.)
#
#   benchmarks/gpu_suite.sh OUT_DIR [more `orbax-mtc bench suite` options]
#
# Needs jax with CUDA, orbax-checkpoint, tensorstore and the project's other dependencies.
# Wheels in .whl/ are installed first (for a machine without a package index). The arrays go on the GPU, so the suite's --fresh-state auto
# saves a fresh device copy each time and holds the blocking time to a device-to-host copy.
set -euo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUT_DIR [suite options]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
if compgen -G "$repo/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/orbax-mtc-site "$repo"/.whl/*.whl
  export PYTHONPATH=/tmp/orbax-mtc-site
fi
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nproc; free -g; df -h /dev/shm
  python3 -c 'import jax, orbax.checkpoint as o; print(jax.__version__, o.__version__, jax.devices())'
} > "$out/machine.txt" 2>&1 || true
JAX_PLATFORMS=cuda python3 -m orbax_mtc bench suite --procs 1 --out "$out" "$@"
