"""The network and its weights: config, transformer, attention seam, families, tokenizers, fetching and loading (lessons 01, 17)."""
