"""Restore, one pipeline for every tier and layout (see `executor` for the RAM stages).

  tiers       RAM, else persistent, else scratch; the replicator's entry (managed mode)
  executor    the one RAM executor: inventory -> plan -> fetch -> build -> outcome
  writeback   the step re-protected where it is not in place, nothing deleted first
  sources     the folders one host can serve (own, set aside, peer copies) and reading them
  plan        which save to restore and who serves each saved rank (pure)
  tiles       a save's layout, the tile streams, new shards from saved tiles (no collectives)
  boxes       box geometry of saved tiles (pure)
  persistent  the persistent tier's restore through Orbax
"""
