"""The most rows one pass attends to row by row (specdec.engine.attention): a verify has K + 1
rows, and --max-speculative-tokens is at most 64; a longer pass is a prefill. Its own module so
that the settings (specdec.config.services), which the coordinator imports too, bound K without
loading torch's and transformers' attention."""

MAX_ROWS = 65
