"""The persistent tier: a plain Orbax manager on the persistent directory (tier.py), the
`dataset` item's own manager (non_replicated.py), and the one place that reads Orbax's
internals (orbax_internals.py)."""
