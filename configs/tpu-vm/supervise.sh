#!/usr/bin/env bash
# Keeps one training job running on this TPU VM worker, detached from the ssh session that
# started it: the launchers copy this file to every worker (~/orbax-mtc-supervise.sh) and run
#
#   supervise.sh start NAME 'COMMAND'   (re)start the job: COMMAND is run with bash
#   supervise.sh stop NAME              stop it (SIGTERM: an on-demand checkpoint first)
#   supervise.sh status NAME            is it running; the end of its log
#   supervise.sh loop NAME              the restart loop itself (what `start` runs)
#
# The loop runs COMMAND until it exits 0 (training finished), restarting it after any other
# status (a crash, a peer lost, the preemption step: the launchers make MaxText end with
# status 75 there, Pax ends with 1) after RESTART_DELAY_S seconds; each restart resumes from
# the checkpoint (RAM, a peer's copy or the bucket). SUPERVISOR=systemd (default) runs it as a
# systemd unit enabled at boot, so it also starts again after the VM is restarted for
# maintenance; SUPERVISOR=nohup runs it in its own session (no sudo needed, but not after a
# reboot). State, the job's log included, is in ORBAX_MTC_STATE/NAME (default
# ~/.orbax-mtc/NAME).
set -euo pipefail

ACTION="${1:-}"
NAME="${2:-}"
STATE_ROOT="${ORBAX_MTC_STATE:-${HOME}/.orbax-mtc}"
SUPERVISOR="${SUPERVISOR:-systemd}"
UNIT_DIR="${UNIT_DIR:-/etc/systemd/system}"
RESTART_DELAY_S="${RESTART_DELAY_S:-30}"
MAX_RESTARTS="${MAX_RESTARTS:-1000}"   # then it gives up and keeps the last status
STOP_TIMEOUT_S="${STOP_TIMEOUT_S:-330}"   # SIGTERM to SIGKILL: the on-demand save's budget

usage() {
  echo "usage: $0 start NAME 'COMMAND' | stop NAME | status NAME | loop NAME" >&2
  exit 2
}

if [[ ! "${ACTION}" =~ ^(start|stop|status|loop)$ || ! "${NAME}" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]]
then
  usage
fi
if [[ ! "${SUPERVISOR}" =~ ^(systemd|nohup)$ ]]; then
  echo "SUPERVISOR=${SUPERVISOR}: use systemd or nohup" >&2
  exit 2
fi
STATE="${STATE_ROOT}/${NAME}"
UNIT="orbax-mtc-${NAME}.service"

note() {
  printf '%s orbax-mtc supervise %s: %s\n' "$(date -u +%FT%TZ)" "${NAME}" "$*" \
    >>"${STATE}/log"
}

# The restart loop. One per job (a lock in its state folder); COMMAND's output goes to the log.
loop() {
  exec 9>>"${STATE}/lock"
  if ! flock -n 9; then
    echo "${NAME} is already running on this worker ($0 stop ${NAME} first)" >&2
    exit 1
  fi
  local runs=0 status
  while true; do
    if [[ -f "${STATE}/done" ]]; then
      note "finished before (remove ${STATE}/done to run it again)"
      exit 0
    fi
    runs=$((runs + 1))
    note "run ${runs}: bash ${STATE}/command.sh"
    status=0
    bash "${STATE}/command.sh" >>"${STATE}/log" 2>&1 9>&- || status=$?
    if ((status == 0)); then
      touch "${STATE}/done"
      note "finished (status 0)"
      exit 0
    fi
    if ((runs > MAX_RESTARTS)); then
      note "status ${status}; ${MAX_RESTARTS} restarts done, giving up"
      exit "${status}"
    fi
    note "status ${status}; restarting in ${RESTART_DELAY_S}s (it resumes from its checkpoint)"
    sleep "${RESTART_DELAY_S}"
  done
}

write_unit() {
  # The environment of the session that started the job (the same python, the same HOME).
  sudo tee "${UNIT_DIR}/${UNIT}" >/dev/null <<EOF
[Unit]
Description=orbax-mtc training job ${NAME} (restarted until it exits 0)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User=$(id -un)
WorkingDirectory=${HOME}
Environment="HOME=${HOME}" "PATH=${PATH}" "ORBAX_MTC_STATE=${STATE_ROOT}"
Environment="RESTART_DELAY_S=${RESTART_DELAY_S}" "MAX_RESTARTS=${MAX_RESTARTS}"
ExecStart=/bin/bash ${STATE}/supervise.sh loop ${NAME}
KillSignal=SIGTERM
TimeoutStopSec=${STOP_TIMEOUT_S}
Restart=no

[Install]
WantedBy=multi-user.target
EOF
}

start() {
  local command="${3:-}"
  [[ -n "${command}" ]] || usage
  mkdir -p "${STATE}"
  cp "${BASH_SOURCE[0]}" "${STATE}/supervise.sh"
  printf '%s\n' "${command}" >"${STATE}/command.sh"
  rm -f "${STATE}/done"
  if [[ "${SUPERVISOR}" == "systemd" ]]; then
    write_unit
    sudo systemctl daemon-reload
    sudo systemctl enable "${UNIT}"
    sudo systemctl restart "${UNIT}"
  else
    if ! (exec 9>>"${STATE}/lock" && flock -n 9); then
      echo "${NAME} is already running on this worker ($0 stop ${NAME} first)" >&2
      exit 1
    fi
    setsid nohup bash "${STATE}/supervise.sh" loop "${NAME}" >>"${STATE}/log" 2>&1 </dev/null &
    echo "$!" >"${STATE}/pid"
  fi
  echo "${NAME}: started under ${SUPERVISOR} on $(hostname); log ${STATE}/log"
}

stop() {
  if [[ "${SUPERVISOR}" == "systemd" ]]; then
    sudo systemctl disable --now "${UNIT}"
  elif [[ -f "${STATE}/pid" ]]; then
    # setsid made the loop the leader of its own process group: end it and the job.
    kill -TERM -- "-$(<"${STATE}/pid")" 2>/dev/null || true
    rm -f "${STATE}/pid"
  fi
  echo "${NAME}: stopped on $(hostname)"
}

status() {
  if [[ "${SUPERVISOR}" == "systemd" ]]; then
    systemctl is-active "${UNIT}" || true
  elif (exec 9>>"${STATE}/lock" && flock -n 9); then
    echo inactive
  else
    echo active
  fi
  [[ -f "${STATE}/done" ]] && echo "finished"
  tail -n "${LOG_LINES:-20}" "${STATE}/log" 2>/dev/null || true
}

case "${ACTION}" in
  start) start "$@" ;;
  stop) stop ;;
  status) status ;;
  loop) loop ;;
esac
