# Shared by the Cloud TPU VM scripts (sourced, not run). DRY_RUN=1 prints every command.

# shellcheck source=../run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../run.sh"

# The TPU nodes of the job: create-queued-resource.sh names one node JOB_NAME, or with
# SLICES > 1 the nodes JOB_NAME-0 ... JOB_NAME-(SLICES-1) (gcloud's --node-prefix naming).
tpu_nodes() {
  if ((SLICES == 1)); then
    echo "${JOB_NAME}"
  else
    local i
    for ((i = 0; i < SLICES; i++)); do echo "${JOB_NAME}-${i}"; done
  fi
}

# Runs one command on every worker of every node at once; fails if any worker fails.
# Before it, each worker checks that LOCAL_DIR's file system has RAMDISK_GI GiB free
# (the size `orbax-mtc size` prints; 0 skips the check).
run_on_all_workers() {
  local command="$1" node pids=() status=0 preamble
  preamble="mkdir -p ${LOCAL_DIR} && avail=\$(df --output=avail -BG ${LOCAL_DIR} | tail -1"
  preamble+=" | tr -dc 0-9) && if [ \"\$avail\" -lt ${RAMDISK_GI} ]; then echo \"${LOCAL_DIR}"
  preamble+=" has \${avail}G free, orbax-mtc size asks for ${RAMDISK_GI}G\" >&2; exit 1; fi"
  for node in $(tpu_nodes); do
    run gcloud compute tpus tpu-vm ssh "${node}" --project="${PROJECT_ID}" --zone="${ZONE}" \
      --worker=all --command="${preamble} && ${command}" &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do wait "${pid}" || status=$?; done
  return "${status}"
}
