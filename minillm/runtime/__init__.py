"""A request's life: the decode session over a cache, batching, the continuous-batching scheduler and engine (lessons 06, 07, 12)."""
