"""Decoding loops over the runtime: generate, speculative decoding, lookahead, beam search, streaming (lessons 02, 03, 07-11)."""
