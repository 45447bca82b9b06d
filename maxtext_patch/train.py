"""`python -m maxtext_patch.train <MaxText train args>`: MaxText's own training entry point
(`maxtext.trainers.pre_train.train`) with its checkpointing on orbax-mtc.

The arguments are MaxText's (a config file, then `key=value` overrides) plus orbax-mtc's own
`mtc_*` keys (`maxtext_patch.config.NEW_KEYS`), which are taken out before MaxText parses the
rest (its config rejects keys it does not know). Example, on every host:

  python -m maxtext_patch.train src/maxtext/configs/base.yml run_name=run1 \\
      base_output_directory=gs://bucket/out enable_emergency_checkpoint=true \\
      local_checkpoint_directory=/local local_checkpoint_period=20 checkpoint_period=1000 \\
      enable_autocheckpoint=true mtc_peers_per_node=1

MaxText ends with status 0 whether training finished or stopped at the preemption step after
a SIGTERM (Autocheckpoint, a maintenance event); `mtc_preemption_exit_code=N` makes the second
end with status N, so that a restart loop (configs/tpu-vm/supervise.sh) starts the job again
only then.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

import maxtext_patch
from maxtext_patch import config as mtc_config
from maxtext_patch import managers
from orbax_mtc import distributed

MAXTEXT_TRAIN_MODULE = "maxtext.trainers.pre_train.train"


def join_launcher_job() -> None:
  """Joins `jax.distributed` as `orbax-mtc launch` tells its children to, before MaxText starts.

  MaxText then finds JAX initialised and skips its own start-up, whose CPU path reads XPK's
  variables (JOB_INDEX, PROCESSES_IN_JOB, a coordinator on port 1234). Outside our launcher
  (no ORBAX_MTC_COORDINATOR) this does nothing and MaxText joins its cluster itself, as always.

  Raises:
    ValueError: If the launcher's variables are malformed (see `distributed.initialize`).
    RuntimeError: If a JAX backend was started before this call.
  """
  if os.environ.get(distributed.ORBAX_MTC_COORDINATOR):
    distributed.initialize()


def main(argv: Sequence[str] | None = None) -> int:
  """Installs the patch and runs MaxText's training module with MaxText's arguments.

  Args:
    argv: MaxText's arguments plus `mtc_*` keys; None reads `sys.argv[1:]`.

  Returns:
    0 after MaxText's training returns (`mtc_preemption_exit_code` when it stopped at the
    preemption step, see `exit_status`); 2 when MaxText is missing or unsupported or an mtc_*
    key is bad (the reason goes to stderr).
  """
  args = list(sys.argv[1:] if argv is None else argv)
  try:
    maxtext_args, ours = mtc_config.split_argv(args)
    version = maxtext_patch.install(**ours)
  except (maxtext_patch.MaxTextNotAvailableError, maxtext_patch.UnsupportedMaxTextError,
          mtc_config.MaxTextConfigError) as e:
    print(f"maxtext_patch.train: {e}", file=sys.stderr)
    return 2
  print(f"maxtext_patch.train: MaxText {version or '(version unknown)'} checkpointing on "
        f"orbax-mtc; running {MAXTEXT_TRAIN_MODULE}", file=sys.stderr, flush=True)
  join_launcher_job()
  # As `python -m maxtext.trainers.pre_train.train ...`: MaxText's absl main reads sys.argv.
  sys.argv = [MAXTEXT_TRAIN_MODULE, *maxtext_args]
  try:
    runpy.run_module(MAXTEXT_TRAIN_MODULE, run_name="__main__", alter_sys=True)
  except SystemExit as e:  # absl's app.run ends MaxText's main with sys.exit
    if e.code not in (None, 0):
      raise
  return exit_status(ours)


def exit_status(keys: dict[str, str]) -> int:
  """The status to end with once MaxText's training has returned.

  Args:
    keys: The orbax-mtc keys of the command line (`mtc_preemption_exit_code` is read).

  Returns:
    `mtc_preemption_exit_code` if the job's multi-tier manager stopped training at its
    preemption step, else 0.
  """
  code = mtc_config.check_new_keys(keys).get("mtc_preemption_exit_code") or 0
  if code and managers.stopped_for_preemption():
    print(f"maxtext_patch.train: training stopped at the preemption step; exit status {code} "
          "(mtc_preemption_exit_code)", file=sys.stderr, flush=True)
    return code
  return 0


if __name__ == "__main__":
  sys.exit(main())
