#!/usr/bin/env bash
# Starts Pax on orbax-mtc on every worker of the job's TPU VMs. --jax_fully_async_checkpoint
# makes Pax join jax.distributed; --exit_after_ondemand_checkpoint makes it stop once the
# on-demand checkpoint after Autocheckpoint's SIGTERM is durable.
#
#   PROJECT_ID=my-project ZONE=us-east5-b JOB_NAME=my-job BUCKET=my-ckpt-bucket \
#     EXP=tasks.lm.params.lm_cloud.LmCloudSpmd2B RAMDISK_GI=36 bash configs/tpu-vm/launch-pax.sh
#
# Needs paxml and orbax-mtc installed on the workers. After a maintenance event, run it
# again: each host restores from its RAM, a peer's copy, or gs://BUCKET/JOB_NAME.
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

run_on_all_workers "${PYTHON} -m pax_patch.main --exp=${EXP} \
--job_log_dir=gs://${BUCKET}/${JOB_NAME} --jax_fully_async_checkpoint=1 \
--exit_after_ondemand_checkpoint=1 --mtc_local_checkpoint_dir=${LOCAL_DIR} \
--mtc_local_save_interval_steps=${LOCAL_PERIOD} --mtc_peers_per_node=${PEERS}"
