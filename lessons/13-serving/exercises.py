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


def request_metrics(sent: float, chunk_times: list[float], end: float, output_tokens: int) -> dict:
    """Exercise 3: Serving metrics and capacity

    One streamed request: sent at `sent`, text chunks arriving at `chunk_times`, the stream ending at `end`,
    `output_tokens` tokens in all. Return {"ttft": first chunk - sent, "tpot": (end - first chunk) /
    (output_tokens - 1) (None for one token), "itl": the gaps between consecutive chunks, a list}.
    """
    raise NotImplementedError


def max_request_rate(batch: int, seconds_per_step: float, mean_output_tokens: float) -> float:
    """Exercise 3: Serving metrics and capacity

    A server whose every step takes `seconds_per_step` and gives one token to each of `batch` requests, serving
    requests of `mean_output_tokens` tokens on average (prefill ignored): the most requests per second it can
    finish. Above it, the queue grows without bound.
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
