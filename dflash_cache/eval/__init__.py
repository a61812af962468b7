"""Evaluation: `dflash eval` (how well an exported drafter speculates for its target) and the
benchmark sets it runs on.

`decode` runs speculative decoding beside the target alone; `replay` gives another drafter's greedy
tau on those outputs without decoding; `metrics` holds the acceptance figures (tau pooled and per
prompt, the histogram) both report. `benchsets` reads the benchmark sets (HumanEval, MT-Bench, a
ShareGPT hold-out) and keeps them out of training, `code_prompts` builds code prompts that are not
HumanEval's, and `sets` runs
`dflash eval-sets` over them. `config` holds both commands' settings.
"""
