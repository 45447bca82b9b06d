"""Every Orbax `SaveDecisionPolicy` on both tiers (issue 40, case 8): the table the tests and
the `policies` sub-command share, and the loop that runs one policy."""

from __future__ import annotations

from typing import Any

STEPS = 10  # each run saves steps 0..9, waiting for both tiers after each


def policies() -> dict[str, tuple[Any, list[int]]]:
  """name -> (a fresh policy, the steps it saves out of 0..STEPS-1 when every save has
  finished before the next: nothing is ever "in progress" when asked)."""
  from orbax.checkpoint import checkpoint_managers as p

  return {
      "fixed-3": (p.FixedIntervalPolicy(3), [0, 3, 6, 9]),
      "specific": (p.SpecificStepsPolicy([2, 5, 7]), [2, 5, 7]),
      "initial": (p.InitialSavePolicy(), [0]),
      "preemption": (p.PreemptionCheckpointingPolicy(), []),
      "continuous": (p.ContinuousCheckpointingPolicy(), list(range(STEPS))),
      "continuous-hour": (p.ContinuousCheckpointingPolicy(minimum_interval_secs=3600), [0]),
      "any": (p.AnySavePolicy([p.FixedIntervalPolicy(4), p.SpecificStepsPolicy([5])]),
              [0, 4, 5, 8]),
  }


def run(tier: str, name: str, local_dir, persistent_dir, mesh, abstract, state_of
        ) -> list[int]:
  """Saves steps 0..STEPS-1 with policy `name` on `tier` ("ram" or "persistent"; the other
  tier never saves on its own) and returns the steps that tier holds."""
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  policy, _ = policies()[name]
  never = ocp.checkpoint_managers.SpecificStepsPolicy([])
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(save_decision_policy=policy if tier == "ram" else never,
                                       max_to_keep=STEPS),
      persistent=mtc.PersistentCheckpointOptions(
          save_decision_policy=policy if tier == "persistent" else never),
      replication=mtc.ReplicationOptions(replica_axis="data"))
  saved = []
  with mtc.CheckpointManager(local_dir, persistent_dir, mesh, abstract,
                             options=options) as mgr:
    for step in range(STEPS):
      if mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state_of(step)))):
        saved.append(step)
      mgr.wait_until_finished()
    held = mgr._form.local.steps() if tier == "ram" else mgr._form.persistent.steps()
  assert held == saved, (tier, name, held, saved)
  return held


def preservations() -> dict[str, tuple[Any, list[int]]]:
  """name -> (a fresh Orbax `PreservationPolicy`, the steps the persistent tier keeps of
  0..STEPS-1 saved one by one within a second or so, each with metrics {"score": step}).
  The RAM tier keeps the same plus its newest step (`kept_in_ram`)."""
  import datetime

  from orbax.checkpoint import checkpoint_managers as p

  return {
      "seconds": (p.EveryNSeconds(3600), [0]),
      "duration": (p.LatestDuration(datetime.timedelta(hours=1)), list(range(STEPS))),
      "closest-4": (p.EveryNStepsClosest(4), [0, 4, 8, 9]),
      "every-3": (p.EveryNSteps(3), [0, 3, 6, 9]),
      "custom": (p.CustomSteps([2, 5, 9]), [2, 5, 9]),
      "any": (p.AnyPreservationPolicy([p.CustomSteps([1, 9]), p.EveryNSteps(4)]),
              [0, 1, 4, 8, 9]),
      "best-2": (p.BestN(get_metric_fn=lambda metrics: metrics["score"], n=2), [8, 9]),
      "latest-3": (p.LatestN(3), [7, 8, 9]),
  }


def kept_in_ram(expected: list[int], processes: int) -> list[int]:
  """What the RAM tier keeps where Orbax's persistent tier keeps `expected`: the newest step
  too, and with several processes the newest step every node held at the last save (the
  floor: STEPS - 2 here) until the next save."""
  return sorted({*expected, STEPS - 1, *([STEPS - 2] if processes > 1 else [])})


def run_preservation(tier: str, name: str, local_dir, persistent_dir, mesh, abstract,
                     state_of) -> list[int]:
  """Saves steps 0..STEPS-1 on both tiers with preservation policy `name` on `tier` and
  returns the steps that tier keeps."""
  import orbax.checkpoint as ocp

  import orbax_mtc as mtc

  policy, _ = preservations()[name]
  options = mtc.CheckpointManagerOptions(
      local=mtc.LocalCheckpointOptions(
          save_interval_steps=1,
          **({"preservation_policy": policy} if tier == "ram" else {"max_to_keep": STEPS})),
      persistent=mtc.PersistentCheckpointOptions(
          save_interval_steps=1, **({"preservation_policy": policy} if tier == "persistent"
                                    else {})),
      replication=mtc.ReplicationOptions(replica_axis="data"))
  with mtc.CheckpointManager(local_dir, persistent_dir, mesh, abstract,
                             options=options) as mgr:
    for step in range(STEPS):
      mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state_of(step))),
               metrics={"score": step})
      mgr.wait_until_finished()
    return mgr._form.local.steps() if tier == "ram" else mgr._form.persistent.steps()
