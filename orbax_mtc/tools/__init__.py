"""The `orbax-mtc` command and the tools behind it; not part of the checkpointing library.

Here: `cli` (the `orbax-mtc` entry point and its verbs' wiring), `launch` (N local processes
as one jax.distributed job), `demo` and `demo_train` (the end-to-end demonstration),
`inspection` (`status`, `verify`), `gc` (retention on a persistent directory), `reach`
(a gs:// endpoint probed before it is used), `console` (the verbs' shared output), `size`
(RAM-disk arithmetic, pure) and `size_render` (saved steps measured, configs/ templates
rendered), and `bench/` (the benchmarks).

The tools import the core (`orbax_mtc.*`); the core never imports this package
(tests/test_layout.py checks it), so `import orbax_mtc` pays nothing for the tools.
"""
