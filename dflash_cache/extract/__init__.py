"""Stage 1: rows -> (input_ids, loss_mask) -> the target's tapped hidden states -> committed cache units.
It writes the cache and never imports the train package. See docs/architecture.md."""
