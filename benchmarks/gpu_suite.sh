#!/usr/bin/env bash
# Every GPU figure of the project, in one call on one GPU, one process. (One GPU per process:
# NCCL does not put two ranks on one GPU, so the multi-process rows need a host with more GPUs.)
#
#   benchmarks/gpu_suite.sh OUT_DIR [PHASE...]
#       PHASE: staging write-threads suite every-step every-step-cpu2 (default: all)
#
# staging:    benchmarks/gpu_staging.py: the save-then-donate bit-exact check, device-to-host
#             pinned vs pageable bandwidth, RAM-disk write with 1 and 4 threads.
# write-threads: benchmarks/write_threads.py: the RAM tier's write of 1 GiB with 1, 2 and 4
#             writer threads (the default there: one per 4 cores, at most 4), same run.
# suite:      `orbax-mtc bench suite` at 1 GiB and 4 GiB (save / raw write, restore / raw read,
#             blocking, loop overhead; against plain Orbax on the same RAM disk).
# every-step: `orbax-mtc bench every-step`, one process, the state on the GPU, 256 MiB and 1 GiB.
# every-step-cpu2: the same with two processes x 256 MiB on the machine's CPUs (peer copies;
#             NCCL does not put two ranks on one GPU), on a quiet 16-core host.
#
# Needs jax with CUDA, orbax-checkpoint, tensorstore and the project's other dependencies.
# Wheels in .whl/ are installed first (for a machine without a package index). Each phase is
# bounded by its own timeout and a failed phase does not stop the next: its log says why.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUT_DIR [PHASE...]}
shift
phases=${*:-staging write-threads suite every-step every-step-cpu2}
repo=$(cd "$(dirname "$0")/.." && pwd)
if compgen -G "$repo/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/orbax-mtc-site "$repo"/.whl/*.whl
  export PYTHONPATH=/tmp/orbax-mtc-site
fi
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export JAX_PLATFORMS=cuda
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nproc; free -g; df -h /dev/shm
  python3 -c 'import jax, orbax.checkpoint as o, importlib.metadata as m; print(jax.__version__, o.__version__, m.version("tensorstore"), jax.devices())'
  python3 -c 'import orbax_mtc; print("orbax_mtc imports")'
} > "$out/machine.txt" 2>&1
status=0
run() {  # run NAME SECONDS COMMAND...: the phase's output in OUT/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*"
  timeout -k 10 "$seconds" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc"
  tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}
for phase in $phases; do
  case $phase in
    staging) run staging 150 python3 "$repo/benchmarks/gpu_staging.py" --mib 1024 8192 \
               --reps 2 --out "$out" ;;
    write-threads) run write-threads 60 python3 "$repo/benchmarks/write_threads.py" --mib 1024 \
                     --threads 1 2 4 --reps 3 ;;
    suite) run suite 330 python3 -m orbax_mtc bench suite --procs 1 --sizes 1024 4096 --reps 2 \
             --ondemand-reps 1 --contenders limits orbax mtc loop --timeout-s 300 --quiet \
             --out "$out" ;;
    every-step) run every-step 150 bash -c "python3 -m orbax_mtc bench every-step --procs 1 \
                  --mib 256 1024 --reps 1 --steps 30 --quiet --json > $out/every-step-gpu.json" ;;
    every-step-cpu2) run every-step-cpu2 150 bash -c "JAX_PLATFORMS=cpu python3 -m orbax_mtc \
                  bench every-step --procs 2 --mib 256 --reps 1 --steps 30 --budget 0.02 \
                  --quiet --json > $out/every-step-cpu2.json" ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
done
exit $status
