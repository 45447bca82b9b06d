"""Peer copies: each node's committed steps copied to other nodes with JAX collectives.

  replication  sending committed steps to peers (a state machine driven from `save()`) and
               the shard groups / own-step reads a restore from peers uses
  store        the copies this node holds for other nodes, under
               `<local>/peers/<source>/<step>/`, and the step streams sent and received

(The chunked transfer itself is `orbax_mtc.transport`.)
"""
