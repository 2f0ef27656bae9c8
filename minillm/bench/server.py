"""`python -m minillm.bench server`: the HTTP server (lesson 13) under load, over loopback.

The server runs as its own process (`python -m minillm.serve --eager`, the default model in
FP32), as it would in production; this process is the clients (`minillm.serving.loadtest`),
streaming chat requests over HTTP. `--eager` keeps the server off a kept compiled graph: a run
after `python -m minillm.compile --serve` measures the same eager server as one before
(`bench serve-vs-llamacpp` measures the compiled one). Three measurements:

- **concurrency**: one client sending its requests one after another, against 16
  clients at once, every request asking for the same number of tokens: how much more
  output the engine's continuous batching delivers, and what it costs each client in
  time to first token (TTFT) and time per output token (TPOT);
- **request rate**: Poisson arrivals at increasing rates (the lesson 12 workload: a
  shared system prompt, long-tailed answers): throughput and p50/p99 latencies;
- **soak**: a fixed time of mixed traffic: well-formed streaming requests, clients that
  disconnect mid-stream, and malformed or impossible requests. Pass: zero failed
  well-formed requests, zero 5xx answers, and afterwards zero requests or KV blocks
  still held (the server's `/stats`).

    python -m minillm.bench server           # about 8 minutes
    python -m minillm.bench server --quick   # about 2 minutes
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx
from tqdm.auto import tqdm

from ..base.ports import free_port
from ..serving.loadtest import chat_workload, run_load, stream_chat, summarize
from .common import REPO, finish_figure, plot_title

SLO_TTFT, SLO_TPOT = 2.0, 0.25  # a chat user waits two seconds for the first words, then reads >= 4 tokens/s
MALFORMED = (  # (body, expected status): each a request a careless client might send
    (b'{"messages": [', 400), (b'"just a string"', 400), ({"messages": []}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}, 404),
    ({"messages": [{"role": "user", "content": "hi " * 6000}]}, 400),  # over the context
    ({"messages": [{"role": "user", "content": "x" * (2 * 2**20)}]}, 413),  # over the body limit
)


def child_env(extra: dict | None = None) -> dict:
    """This process's environment for a child that imports this checkout's minillm, plus `extra`."""
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra or {}))


class ServerProcess:
    """An OpenAI-compatible server in a child process (`python -m minillm.serve`, or another engine's), ready once
    `GET /v1/models` answers, which every such server has. Its log goes to a file, read when it fails to start: a
    pipe nobody reads would fill and stall a server that logs every request."""

    def __init__(self, command: list[str], port: int, env: dict | None = None):
        """env: variables set for the child on top of this process's own."""
        self.command, self.port, self.env = command, port, env or {}
        self.base_url = f"http://127.0.0.1:{port}/v1"

    @classmethod
    def minillm(cls, model: str, device: str, max_num_seqs: int, *flags: str, env: dict | None = None):
        port = free_port()
        return cls([sys.executable, "-m", "minillm.serve", "--model", model, "--device", device, "--port", str(port),
                    "--max-num-seqs", str(max_num_seqs), *flags], port, env)

    def __enter__(self) -> "ServerProcess":
        env = child_env(self.env)
        self.log = tempfile.TemporaryFile(mode="w+")
        start = time.monotonic()
        self.process = subprocess.Popen(self.command, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = start + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{' '.join(self.command[1:3])} exited while starting: {self.log.read()[-2000:]}")
            try:
                if httpx.get(self.base_url + "/models", timeout=1).status_code == 200:
                    self.ready_seconds = time.monotonic() - start  # its start, as a user waits for it
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"{' '.join(self.command[1:3])} did not answer /v1/models within 300 s")

    def stats(self) -> dict:
        return httpx.get(self.base_url.removesuffix("/v1") + "/stats", timeout=10).json()

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def load(server: ServerProcess, workload, concurrency=None, desc: str = "") -> dict:
    with tqdm(total=len(workload), desc=desc, leave=False, disable=None) as progress:
        outcomes = asyncio.run(run_load(server.base_url, "default", workload, concurrency, progress=progress))
    return summarize(outcomes, SLO_TTFT, SLO_TPOT)


async def soak(base_url: str, seconds: float, clients: int, seed: int = 0) -> dict:
    """`clients` loops of mixed traffic for `seconds`; counts what a server must never do."""
    rng = random.Random(seed)
    counts = {"well_formed": 0, "well_formed_failed": 0, "abandoned": 0, "malformed": 0, "malformed_wrong_status": 0,
              "server_errors": 0}
    failures: list[str] = []
    questions = chat_workload(64, math.inf, seed=seed, outputs=((8, 64), (8, 64), 0.0))
    end = time.perf_counter() + seconds

    async def client(http: httpx.AsyncClient):
        while time.perf_counter() < end:
            kind = rng.choice(("good", "good", "good", "abandon", "malformed"))
            if kind == "malformed":
                body, status = rng.choice(MALFORMED)
                sent = {"content": body} if isinstance(body, bytes) else {"json": body}
                response = await http.post("/chat/completions", headers={"Content-Type": "application/json"}, **sent)
                counts["malformed"] += 1
                counts["server_errors"] += response.status_code >= 500
                counts["malformed_wrong_status"] += response.status_code != status
            elif kind == "abandon":  # read a few chunks, then hang up
                counts["abandoned"] += 1
                async with http.stream("POST", "/chat/completions",
                                       json={"model": "default", "messages": rng.choice(questions).messages,
                                             "max_tokens": 200, "stream": True}) as response:
                    counts["server_errors"] += response.status_code >= 500
                    lines = 0
                    async for _ in response.aiter_lines():
                        lines += 1
                        if lines >= rng.randint(1, 8):
                            break
            else:
                outcome = await stream_chat(http, "default", rng.choice(questions))
                counts["well_formed"] += 1
                counts["server_errors"] += (outcome.status or 0) >= 500
                if not outcome.ok:
                    counts["well_formed_failed"] += 1
                    failures.append(f"{outcome.status}: {outcome.error}")

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=10)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return {**counts, "seconds": seconds, "clients": clients, "failures": failures[:5]}


def wait_until_idle(server: ServerProcess, timeout: float = 60) -> dict:
    """The server's counters once it holds nothing, or after `timeout` (then the leak shows in them)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats["requests_held"] == 0 and stats["blocks_free"] == stats["blocks_total"]:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def run(args) -> dict:
    quick = args.quick
    clients, tokens = 16, 64
    single_requests, crowd_requests = (3, 16) if quick else (8, 64)
    rates = [1.0, 4.0] if quick else [0.5, 1.0, 2.0, 4.0]
    per_rate = 8 if quick else 24
    soak_seconds, soak_clients = (15, 8) if quick else (120, 12)
    fixed = ((tokens, tokens), (tokens, tokens), 0.0)
    with ServerProcess.minillm(args.model, args.device, clients, "--eager") as server:
        load(server, chat_workload(4, math.inf, seed=99, outputs=((8, 8), (8, 8), 0.0)), desc="warm-up")
        single = load(server, chat_workload(single_requests, math.inf, seed=1, outputs=fixed), concurrency=1,
                      desc="1 client")
        crowd = load(server, chat_workload(crowd_requests, math.inf, seed=2, outputs=fixed), concurrency=clients,
                     desc=f"{clients} clients")
        print(f"1 client {single['tokens_per_second']:.1f} tok/s, {clients} clients {crowd['tokens_per_second']:.1f} "
              f"tok/s ({crowd['tokens_per_second'] / single['tokens_per_second']:.2f}x)", flush=True)
        by_rate = []
        for rate in rates:
            row = load(server, chat_workload(per_rate, rate, seed=3), desc=f"{rate:g} req/s")
            by_rate.append({"rate": rate, **row})
            print(f"{rate:g} req/s: {row['tokens_per_second']:.1f} tok/s, p99 TTFT {row['ttft']['p99']:.2f} s, "
                  f"p99 TPOT {row['tpot']['p99'] * 1000:.0f} ms", flush=True)
        print(f"soak: {soak_seconds} s of mixed traffic from {soak_clients} clients ...", flush=True)
        soaked = asyncio.run(soak(server.base_url, soak_seconds, soak_clients))
        stats = wait_until_idle(server)
        soaked.update(requests_held_after=stats["requests_held"],
                      blocks_leaked=stats["blocks_total"] - stats["blocks_free"],
                      requests_aborted=stats["requests_aborted"])
        print(f"soak: {soaked['well_formed']} well-formed ({soaked['well_formed_failed']} failed), "
              f"{soaked['abandoned']} abandoned, {soaked['malformed']} malformed, {soaked['server_errors']} 5xx, "
              f"{soaked['blocks_leaked']} blocks leaked", flush=True)
    return {"model": args.model, "dtype": "float32", "clients": clients, "tokens_per_request": tokens,
            "slo": {"ttft": SLO_TTFT, "tpot": SLO_TPOT}, "server": " ".join(server.command[1:]),
            "concurrency": {"single": single, "crowd": crowd,
                            "speedup": crowd["tokens_per_second"] / single["tokens_per_second"]},
            "rates": by_rate, "soak": soaked}


def plot(data: dict, path) -> None:
    """Throughput and latency against request rate; one client against many."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_lat, ax_crowd) = plt.subplots(1, 3, figsize=(15, 4.6))
    rows = data["rates"]
    rates = [r["rate"] for r in rows]
    ax_tp.plot(rates, [r["tokens_per_second"] for r in rows], "o-", label="output tokens / s")
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_title("throughput")
    for metric, color in (("ttft", "tab:blue"), ("tpot", "tab:orange")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax_lat.plot(rates, [r[metric][q] for r in rows], style, color=color, label=f"{metric.upper()} {q}")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("seconds")
    ax_lat.set_title("latency")
    ax_lat.legend(fontsize=8)
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request rate (requests / s, Poisson arrivals)")
        ax.grid(alpha=0.3)
    c = data["concurrency"]
    labels = ["1 client", f"{data['clients']} clients"]
    bars = ax_crowd.bar(labels, [c["single"]["tokens_per_second"], c["crowd"]["tokens_per_second"]],
                        color=["tab:gray", "tab:blue"])
    for bar, run in zip(bars, (c["single"], c["crowd"])):
        ax_crowd.annotate(f"TTFT p50 {run['ttft']['p50']:.2f} s\nTPOT p50 {run['tpot']['p50'] * 1000:.0f} ms",
                          (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax_crowd.set_ylabel("aggregate output tokens / s")
    ax_crowd.set_title(f"streaming clients at once: {c['speedup']:.1f}x")
    ax_crowd.margins(y=0.25)
    fig.suptitle(plot_title("The HTTP server under load", data, data["dtype"]) +
                 f"\nstreaming chat requests over loopback; {data['tokens_per_request']} tokens per request in the "
                 f"client comparison", fontsize=10)
    finish_figure(fig, path)
