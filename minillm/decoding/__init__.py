"""Choosing the next token and knowing when to stop: settings, logits processors, sampling, stop strings,
incremental text, structured output (lessons 02-04, 09, 18)."""
