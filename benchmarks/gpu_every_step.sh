#!/usr/bin/env bash
# `orbax-mtc bench every-step` with the state on one GPU (one process), then the two-process
# rows on this machine's CPUs (NCCL does not put two ranks on one GPU).
#
#   benchmarks/gpu_every_step.sh OUT_DIR [more `orbax-mtc bench every-step` options]
#
# Needs jax with CUDA, orbax-checkpoint, tensorstore and the project's other dependencies;
# wheels in .whl/ are installed first (for a machine without a package index). Writes
# OUT_DIR/machine.txt, every-step-gpu.json (one process, arrays on the GPU) and
# every-step-cpu-2procs.json (two processes x 256 MiB, arrays on the CPU, CPU_REPS repetitions,
# default 3), tables in the .md beside each.
set -euo pipefail
out=${1:?usage: benchmarks/gpu_every_step.sh OUT_DIR [every-step options]}
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
JAX_PLATFORMS=cuda python3 -m orbax_mtc bench every-step --procs 1 --json --quiet "$@" \
  > "$out/every-step-gpu.json" 2> "$out/every-step-gpu.md"
JAX_PLATFORMS=cpu python3 -m orbax_mtc bench every-step --json --quiet "$@" --procs 2 --mib 256 \
  --reps "${CPU_REPS:-3}" \
  > "$out/every-step-cpu-2procs.json" 2> "$out/every-step-cpu-2procs.md"
