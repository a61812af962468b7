"""The GPU suite: the code paths that run only on a GPU, each against an independent computation.
Marked `gpu` and skipped without CUDA; run them with tests/gpu/run on a GPU machine (see
docs/reference/testing.md) after any change under generate/, drafters/, the training objective or
the target loader.

A package, so that its conftest.py and modules import under their own names (`gpu.conftest`,
`gpu.common`) beside tests/conftest.py, with tests/ on the path for `helpers` and the test modules
they borrow from."""
