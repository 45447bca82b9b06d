"""Child program of the multi-process tests: one JAX process of a `jax.distributed` job.

Run the folder, `python tests/mp_worker <sub-command> ...` (what `mp_helpers.WORKER` names);
`__main__` lists the sub-commands and exit codes. Modules:

  events        the `@@mtc` event lines: written by the worker, parsed by the tests (no JAX)
  common        mesh, state, manager, restore-and-check, save loop, exit codes
  save_restore  save, restore, resave, chaos, steps, open, force-old, mirror
  preempt       preempt
  faults        fault, mismatch, outage
  plain         plain-restore, transport, managed-init
  hooks         every hook that touches the manager's private members (listed there)
  seams         restore-exit, items, restore-transient, pos (tests/test_restore_seams.py)

Importing the package or `events` imports no JAX.
"""
