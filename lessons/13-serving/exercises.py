"""Lesson 13 exercises: write your answers here; `pytest lessons/13-serving` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/13_serving.py (try first!).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def sse_data(chunks: Iterable[bytes]) -> Iterator[str]:
    """Exercise 1: Server-sent events

    A streaming client must read any server's `text/event-stream`, not only the tidy `data: {json}\\n\\n` lines
    minillm writes, and it must read it as the network delivers it: in pieces cut anywhere. Write a generator.

    `chunks`: the response body as it arrives, bytes cut at arbitrary places (in the middle of a line, between
    the \\r and the \\n of a line end, inside a multi-byte UTF-8 character). Yield the data of each event, in
    order, as soon as the blank line that ends it has arrived (before reading the next chunk), following the
    WHATWG rules for event streams:
      * a line ends at \\r\\n, \\n or \\r; the stream is UTF-8;
      * a blank line ends (dispatches) the event; an event that had no `data` line is not dispatched;
      * a line starting with ':' is a comment; any other line is `field:value` (a line with no ':' is a field
        with an empty value), and ONE space after the colon, if there is one, is not part of the value;
      * only the field `data` matters here (event, id, retry and unknown fields are ignored); several `data`
        lines in one event are joined with '\\n';
      * an event cut off by the end of the stream (no blank line after it) is dropped.
    Stop, without yielding it and without reading any further chunk, at an event whose data is `[DONE]`
    (OpenAI's end of stream).

    The check decodes the package's own encoder output cut at every byte, the WHATWG edge cases by hand, random
    streams against the `openai` client's decoder, and a real stream from the package's server.
    """
    raise NotImplementedError


def to_sampling_config(body: dict, max_new_tokens: int):
    """Exercise 2: OpenAI's parameters as minillm settings

    A request body (a dict with any of temperature, top_p, seed, stop, presence_penalty, frequency_penalty, and the
    extras top_k, min_p, repetition_penalty) -> minillm.decoding.sampling.SamplingConfig for choice 0, with OpenAI's
    defaults: sampling on at temperature 1 unless the body says otherwise (temperature 0 is greedy); `stop` may be
    one string or a list; absent fields keep SamplingConfig's defaults.
    """
    raise NotImplementedError


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Exercise 3: Quantiles from a scrape

    A Prometheus histogram keeps no samples, only cumulative counts: `buckets` is [(upper bound `le`, how many
    observations were <= it)], ascending, the last bound float("inf") (its count: every observation). Return
    the q-quantile (0 <= q <= 1) the way Prometheus' `histogram_quantile` estimates it: the rank q · total falls
    in the first bucket whose count reaches it, and the estimate interpolates linearly inside that bucket, from
    the previous bound (0 for the first bucket) to its own. A rank in the +Inf bucket has no upper end: return
    the largest finite bound. No observations: return NaN.
    """
    raise NotImplementedError


def quantile_from_scrape(text: str, histogram: str, q: float) -> float:
    """Exercise 3: Quantiles from a scrape

    `text` is one scrape of `GET /metrics` (Prometheus' text format); `histogram` the name of one histogram in
    it, such as "minillm_time_to_first_token_seconds". Read its `_bucket` samples (with prometheus_client's own
    parser, `prometheus_client.parser.text_string_to_metric_families`) and return `histogram_quantile(q, ...)`.
    """
    raise NotImplementedError


def p99_latency(arrival_rate: float, service_rate: float) -> float:
    """Exercise 4: Predict p99 from the arrival rate

    Predict before you measure. Requests arrive at random (a Poisson process, `arrival_rate` per second) at one
    server that handles one request at a time, first come first served, each taking an exponentially distributed
    time with mean 1 / `service_rate` (an M/M/1 queue: the simplest model of a server's front door, such as a
    prefill slot). Return the 99th percentile of the time a request spends in the system (waiting + served).
    Raise ValueError when arrival_rate >= service_rate: the queue then grows without bound and has no p99.

    Hint: in an M/M/1 queue the time in the system is itself exponentially distributed; find its rate.
    The check runs a simulated queue (200 000 seeded requests), never a timed one.
    """
    raise NotImplementedError


def max_rate_under_slo(service_rate: float, p99_slo: float) -> float:
    """Exercise 4: Predict p99 from the arrival rate

    The same queue, turned around: the highest arrival rate whose p99 time in the system stays within
    `p99_slo` seconds (0 if even an idle server misses it). This is capacity planning: how much traffic a
    server can take before its slowest 1% breaks the promise.
    """
    raise NotImplementedError
