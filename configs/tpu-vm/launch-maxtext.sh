#!/usr/bin/env bash
# Starts MaxText on orbax-mtc (standalone mode) on every worker of the job's TPU VMs.
# Each host keeps RAM steps in LOCAL_DIR (tmpfs), copies them to a peer with JAX collectives,
# and backs up to gs://BUCKET; SIGTERM from Autocheckpoint becomes an on-demand checkpoint.
#
#   PROJECT_ID=my-project ZONE=us-east5-b JOB_NAME=my-job SLICES=2 BUCKET=my-ckpt-bucket \
#     RAMDISK_GI=36 bash configs/tpu-vm/launch-maxtext.sh
#
# Needs MaxText and orbax-mtc installed on the workers (in MAXTEXT_DIR). Training runs detached
# under supervise.sh on every worker (a systemd unit by default): a dropped ssh connection does
# not end it, and it is started again after any end but a finished run (a crash, a lost peer,
# the preemption step, which ends with status 75 here: mtc_preemption_exit_code) and after the
# VM is restarted for maintenance; each start restores from its RAM, a peer's copy, or the
# bucket. ACTION=status shows each worker's state and log, ACTION=stop stops the job.
# Every setting is an environment variable with a default; DRY_RUN=1 prints the commands.
set -euo pipefail

PROJECT_ID="${PROJECT_ID:-my-project}"
ZONE="${ZONE:-us-east5-b}"
JOB_NAME="${JOB_NAME:-mtc-job}"                 # as given to create-*.sh; MaxText's run_name
SLICES="${SLICES:-1}"
BUCKET="${BUCKET:-my-ckpt-bucket}"
LOCAL_DIR="${LOCAL_DIR:-/dev/shm/ckpt}"         # tmpfs on every TPU VM
RAMDISK_GI="${RAMDISK_GI:-0}"                   # from `orbax-mtc size`; 0: no check
LOCAL_PERIOD="${LOCAL_PERIOD:-20}"              # RAM checkpoint every N steps
CHECKPOINT_PERIOD="${CHECKPOINT_PERIOD:-200}"   # persistent backup every N steps
PEERS="${PEERS:-1}"                             # hosts keeping a copy of each host's step
MAXTEXT_DIR="${MAXTEXT_DIR:-~/maxtext}"
PYTHON="${PYTHON:-python3}"
MAXTEXT_ARGS="${MAXTEXT_ARGS:-dataset_type=synthetic steps=10000}"   # model, data, steps

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

supervise_on_all_workers "${JOB_NAME}" "cd ${MAXTEXT_DIR} && ${PYTHON} -m maxtext_patch.train \
src/maxtext/configs/base.yml run_name=${JOB_NAME} base_output_directory=gs://${BUCKET} \
enable_emergency_checkpoint=true local_checkpoint_directory=${LOCAL_DIR} \
local_checkpoint_period=${LOCAL_PERIOD} checkpoint_period=${CHECKPOINT_PERIOD} \
mtc_peers_per_node=${PEERS} enable_autocheckpoint=true mtc_preemption_exit_code=75 \
${MAXTEXT_ARGS}"
