"""Key/value caches: contiguous per-row caches (lesson 06) and the paged block pool with prefix caching (lesson 12)."""
