"""Stage 2: committed cache units -> batches -> the DFlash drafter, its checkpoints and its export.
It only reads the cache and never imports the extract package. See docs/architecture.md."""
