"""Benchmarks of the project's stages beside the tools people use instead (TRL, its defaults
and best settings), and their committed results under bench/results/. Run each from the
repository root as a module, `python -m bench.<name> ...` (its docstring gives the line), so
that `stages` is this checkout's; `--tiny` runs a bench's code on the CPU in a minute or two
(tests/test_bench.py), docs/performance.md has the figures and where each came from."""
