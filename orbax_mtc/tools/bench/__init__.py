"""`orbax-mtc bench`: measurements of orbax-mtc beside Orbax and the machine's limits."""
