"""The cache contract: what a cache is (spec), how a unit is laid out on disk (unit), how units are
committed and found (store), and the whole-cache checks (audit). Both stages build on this package;
it imports neither. See docs/architecture.md."""
