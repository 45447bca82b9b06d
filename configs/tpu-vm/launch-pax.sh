#!/usr/bin/env bash
# Starts Pax on orbax-mtc on every worker of the job's TPU VMs. --jax_fully_async_checkpoint
# makes Pax join jax.distributed; --exit_after_ondemand_checkpoint makes it stop once the
# on-demand checkpoint after Autocheckpoint's SIGTERM is durable.
#
#   PROJECT_ID=my-project ZONE=us-east5-b JOB_NAME=my-job BUCKET=my-ckpt-bucket \
#     EXP=tasks.lm.params.lm_cloud.LmCloudSpmd2B RAMDISK_GI=36 bash configs/tpu-vm/launch-pax.sh
#
# Needs paxml and orbax-mtc installed on the workers. Training runs detached under
# supervise.sh on every worker (a systemd unit by default) and is started again after any end
# but a finished run (Pax ends with status 1 after the on-demand checkpoint) and after the VM
# is restarted for maintenance: each start restores from its RAM, a peer's copy, or
# gs://BUCKET/JOB_NAME. ACTION=status shows each worker's state and log, ACTION=stop stops it.
# Every setting is an environment variable with a default; DRY_RUN=1 prints the commands.
set -euo pipefail

PROJECT_ID="${PROJECT_ID:-my-project}"
ZONE="${ZONE:-us-east5-b}"
JOB_NAME="${JOB_NAME:-mtc-job}"
SLICES="${SLICES:-1}"
BUCKET="${BUCKET:-my-ckpt-bucket}"
EXP="${EXP:-tasks.lm.params.lm_cloud.LmCloudSpmd2B}"   # the Pax experiment to train
LOCAL_DIR="${LOCAL_DIR:-/dev/shm/ckpt}"
RAMDISK_GI="${RAMDISK_GI:-0}"
LOCAL_PERIOD="${LOCAL_PERIOD:-100}"             # RAM checkpoint every N steps
PEERS="${PEERS:-1}"
PYTHON="${PYTHON:-python3}"

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

supervise_on_all_workers "${JOB_NAME}" "${PYTHON} -m pax_patch.main --exp=${EXP} \
--job_log_dir=gs://${BUCKET}/${JOB_NAME} --jax_fully_async_checkpoint=1 \
--exit_after_ondemand_checkpoint=1 --mtc_local_checkpoint_dir=${LOCAL_DIR} \
--mtc_local_save_interval_steps=${LOCAL_PERIOD} --mtc_peers_per_node=${PEERS}"
