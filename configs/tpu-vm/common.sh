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

# Runs one command on every worker of every node at once (over ssh); fails if any fails.
run_on_all_workers() {
  local command="$1" node pids=() status=0
  for node in $(tpu_nodes); do
    run gcloud compute tpus tpu-vm ssh "${node}" --project="${PROJECT_ID}" --zone="${ZONE}" \
      --worker=all --command="${command}" &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do wait "${pid}" || status=$?; done
  return "${status}"
}

# Copies one file to the home folder of every worker of every node.
copy_to_all_workers() {
  local source="$1" target="$2" node pids=() status=0
  for node in $(tpu_nodes); do
    run gcloud compute tpus tpu-vm scp "${source}" "${node}:${target}" \
      --project="${PROJECT_ID}" --zone="${ZONE}" --worker=all &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do wait "${pid}" || status=$?; done
  return "${status}"
}

# ACTION=start (default) starts COMMAND on every worker under supervise.sh, detached from
# this ssh session and restarted until it exits 0 (see supervise.sh); ACTION=stop stops it,
# ACTION=status shows its state and the end of its log. Before starting, each worker checks
# that LOCAL_DIR's file system has RAMDISK_GI GiB free (the size `orbax-mtc size` prints; 0
# skips the check), so that a RAM disk too small fails here rather than in a restart loop.
ACTION="${ACTION:-start}"
SUPERVISOR="${SUPERVISOR:-systemd}"       # nohup: no sudo, but no start after a reboot
RESTART_DELAY_S="${RESTART_DELAY_S:-30}"
SUPERVISE_SCRIPT="$(dirname "${BASH_SOURCE[0]}")/supervise.sh"
REMOTE_SUPERVISE="orbax-mtc-supervise.sh"   # in each worker's home folder

supervise_on_all_workers() {
  local name="$1" command="${2:-}" check="" remote
  if [[ ! "${ACTION}" =~ ^(start|stop|status)$ ]]; then
    echo "ACTION=${ACTION}: use start, stop or status" >&2
    exit 2
  fi
  remote="SUPERVISOR=${SUPERVISOR} RESTART_DELAY_S=${RESTART_DELAY_S}"
  remote+=" bash \${HOME}/${REMOTE_SUPERVISE} ${ACTION} ${name}"
  if [[ "${ACTION}" == "start" ]]; then
    check="mkdir -p ${LOCAL_DIR} && avail=\$(df --output=avail -BG ${LOCAL_DIR} | tail -1"
    check+=" | tr -dc 0-9) && if [ \"\$avail\" -lt ${RAMDISK_GI} ]; then echo \"${LOCAL_DIR}"
    check+=" has \${avail}G free, orbax-mtc size asks for ${RAMDISK_GI}G\" >&2; exit 1; fi && "
    copy_to_all_workers "${SUPERVISE_SCRIPT}" "${REMOTE_SUPERVISE}"
    # A restarted VM has an empty /dev/shm: each run makes LOCAL_DIR again.
    remote+=" $(printf '%q' "mkdir -p ${LOCAL_DIR} && ${command}")"
  fi
  run_on_all_workers "${check}${remote}"
}
