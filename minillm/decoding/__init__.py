"""Choosing the next token and knowing when to stop: settings, logits processors, sampling, stop strings, incremental text (lessons 02-04, 09)."""
