"""Prometheus metrics of one server (`GET /metrics`): its queue, batch, KV blocks, tokens and latencies.

vLLM's and llama.cpp's servers expose these so that a dashboard, an alert or an
autoscaler can watch a deployment; the engine knows them all. Two kinds, fed two ways:

    gauges       what the engine holds now (waiting and running requests, KV blocks,
                 the prefix cache's hit rate): read from the engine at each scrape
    counters,    what finished requests did (prompt and generated tokens, requests by
    histograms   finish reason, time to first token, time per output token, whole
                 request): fed once per request as it ends, from its `Sequence`'s
                 timings (arrival, each token, finish)

Each server has its own registry, so several servers in one process (tests, a
notebook) never mix their counts. The text format is Prometheus' own
(`prometheus_client.generate_latest`), which any Prometheus scraper reads.

The same series under vLLM's names (and llama.cpp's `llama-server --metrics`), so a dashboard
built for either reads these with a change of names only:

    minillm_requests_waiting / _running      vllm:num_requests_waiting / _running
                                             (llamacpp:requests_deferred / requests_processing)
    minillm_kv_blocks_used / _total          their ratio is vllm:kv_cache_usage_perc
                                             (llamacpp:kv_cache_usage_ratio in older builds)
    minillm_prefix_cache_hit_rate            vllm:prefix_cache_hits / vllm:prefix_cache_queries
    minillm_prompt_tokens_total              vllm:prompt_tokens_total (llamacpp:prompt_tokens_total)
    minillm_generation_tokens_total          vllm:generation_tokens_total (llamacpp:tokens_predicted_total)
    minillm_requests_finished_total          vllm:request_success_total{finished_reason}
    minillm_time_to_first_token_seconds      vllm:time_to_first_token_seconds
    minillm_time_per_output_token_seconds    vllm:request_time_per_output_token_seconds
    minillm_e2e_request_latency_seconds      vllm:e2e_request_latency_seconds

The token counters move when a request ends, not at each step as vLLM's do: over a `rate()`
window of minutes the two agree, over seconds a long request shows up all at once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..runtime.sequence import Sequence

# Bucket edges in seconds: a first token from tens of milliseconds (short prompt, idle server) to minutes (a queue);
# a token every few milliseconds (a GPU) to about a second (a busy CPU).
REQUEST_BUCKETS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The metrics of one served model; `request_finished` feeds them, `render` writes the scrape's text."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name, text):
            return Gauge(f"minillm_{name}", text, labels, registry=registry).labels(model_name)

        def counter(name, text):
            return Counter(f"minillm_{name}", text, labels, registry=registry).labels(model_name)

        def histogram(name, text, buckets):
            return Histogram(f"minillm_{name}", text, labels, buckets=buckets, registry=registry).labels(model_name)

        self.waiting = gauge("requests_waiting", "Requests queued for a place in the batch")
        self.running = gauge("requests_running", "Requests in the batch (prefilling or decoding)")
        self.blocks_used = gauge("kv_blocks_used", "KV cache blocks holding keys (shared prefix blocks count once)")
        self.blocks_total = gauge("kv_blocks_total", "KV cache blocks in the pool")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate",
                                     "Share of admitted prompt tokens whose keys came from the prefix cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests")
        self.finished = Counter("minillm_requests_finished", "Requests that ended, by finish reason",
                                [*labels, "finish_reason"], registry=registry)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "From a request's arrival to its first token", REQUEST_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Mean time between a request's tokens after the first", TOKEN_BUCKETS)
        self.request_latency = histogram("e2e_request_latency_seconds", "From a request's arrival to its end",
                                         REQUEST_BUCKETS)

    def request_finished(self, seq: Sequence) -> None:
        """Count one ended request (finished or aborted); runs on the engine thread, once per request."""
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.generation_tokens.inc(len(seq.generated))
        self.finished.labels(self.model_name, seq.state.finish_reason or "abort").inc()
        times = seq.token_times
        if times:
            self.time_to_first_token.observe(times[0] - seq.arrival_time)
        if len(times) > 1:
            self.time_per_output_token.observe((times[-1] - times[0]) / (len(times) - 1))
        if seq.finish_time is not None:
            self.request_latency.observe(seq.finish_time - seq.arrival_time)

    def render(self, stats: dict) -> bytes:
        """The scrape's text, with the gauges set from `stats` (the engine's counters, read on its thread)."""
        self.waiting.set(stats["requests_waiting"])
        self.running.set(stats["requests_running"])
        self.blocks_used.set(stats["blocks_total"] - stats["blocks_free"])
        self.blocks_total.set(stats["blocks_total"])
        self.prefix_hit_rate.set(stats["prefix_hit_rate"])
        return generate_latest(self.registry)


__all__ = ["ServerMetrics", "REQUEST_BUCKETS", "TOKEN_BUCKETS"]
