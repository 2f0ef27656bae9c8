"""`python -m minillm.serve`: the command that loads a model and serves it over OpenAI's HTTP API (lesson 13).

The server itself (routes, validation, streaming, the engine's thread) is built in
`minillm.serving.server`; this file is the front end a user starts: its flags, their
checks (each bad value one line, before anything loads), the listening socket (bound
before the model loads, so a taken port fails in a second) and uvicorn.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .base.commands import OneLineParser, add_graph_flags, add_model_flags, add_quant_flag, run_command
from .parallel.command import check_sharded_flags
from .serving.launch import bind, build_server

EPILOG = """examples:
  python -m minillm.serve                                  # the default model on http://127.0.0.1:8000/v1
  python -m minillm.serve --port 8001 --max-num-seqs 32 --kv-cache-mb 512
  python -m minillm.serve --model ./my-llama-folder --served-model-name my-llama
  python -m minillm.serve --quant gguf                     # the GGUF's own 4-bit blocks (lesson 14)
  python -m minillm.serve --compile                        # decode steps as one compiled graph (built once)

then, from any OpenAI client:
  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
  client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}])
"""


ENGINE, LIMITS = "engine (lesson 12)", "limits"
# The numeric flags, each with the rule its value must meet (checked before anything loads):
#   (group, flag, type, default, metavar, rule, help)
NUMBERS = (
    (ENGINE, "--max-num-seqs", int, 16, "N", ">= 1", "most requests decoding together in one batch (default 16)"),
    (ENGINE, "--max-num-batched-tokens", int, 512, "N", ">= 1",
     "token budget of one forward; longer prompts are prefilled in chunks (default 512)"),
    (ENGINE, "--kv-cache-mb", float, 256, "MB", "> 0", "size of the paged KV cache pool in megabytes (default 256)"),
    (ENGINE, "--block-size", int, 16, "N", ">= 1", "token slots per KV block (default 16)"),
    (ENGINE, "--max-model-len", int, None, "N", ">= 2",
     "longest prompt + answer in tokens (default: the model's context, or what the KV pool holds if less)"),
    (LIMITS, "--max-waiting", int, 64, "N", ">= 0",
     "requests that may queue for a place in the batch; beyond that the answer is 503 with Retry-After (default 64)"),
    (LIMITS, "--request-timeout", float, 600, "SECONDS", "> 0",
     "a request running longer ends with finish_reason 'length' (default 600)"),
    (LIMITS, "--max-body-mb", float, 1, "MB", "> 0", "larger request bodies are refused with 413 (default 1)"),
)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillm.serve", epilog=EPILOG,
                      description="Serve a minillm model over OpenAI's HTTP API (completions, chat, streaming).",
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, model_help="the model to serve: 'default' (SmolLM2-135M-Instruct), another name "
                    "`python -m minillm.infer` accepts, or a local folder or GGUF file",
                    dtype_help="weights and activations: float32 (default), bfloat16, float16")
    add_quant_flag(p)
    add_graph_flags(p, compile_help="run the engine's decode steps (every request decoding one token) as the "
                    "compiled graph (lessons 12 and 15), building it first when it is not on disk (a few minutes on "
                    "two cores, once; `python -m minillm.compile --serve` builds it ahead; on a GPU compiled at "
                    "start and captured per bucket of rows and blocks). Without this flag the compiled graph runs "
                    "when it is already built, else eager PyTorch; steps that prefill "
                    "prompts always run eagerly; the path is printed at start")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism (lesson 20): split the model over N processes; this one serves HTTP, "
                        "schedules and samples, and sends each step to the others (started here, or by `torchrun "
                        "--nproc-per-node N`), which compute it on their shards; eager path, float weights")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the name clients put in the request's 'model' field (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1, this machine only; 0.0.0.0 exposes the server, which has "
                        "no authentication, to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    groups = {name: p.add_argument_group(name) for name in (ENGINE, LIMITS)}
    for group, flag, kind, default, metavar, rule, text in NUMBERS:
        groups[group].add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    groups[ENGINE].add_argument("--no-prefix-caching", action="store_true",
                                help="do not reuse the keys of prompt prefixes that earlier requests computed")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's logging; 'info' logs every request (default warning)")
    return p


def check_args(args) -> None:
    """Each number against its rule in NUMBERS, the port and the graph mode: a bad value is one line, before the
    model loads."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is invalid: must be in 0..65535")
    check_sharded_flags(args.tp, args.compile, args.quant)
    for _, flag, _, _, _, rule, _ in NUMBERS:
        value, (op, bound) = getattr(args, flag[2:].replace("-", "_")), rule.split()
        if value is not None and not (value >= float(bound) if op == ">=" else value > float(bound)):
            raise ValueError(f"{flag} {value} is invalid: must be {rule}")


def run(args) -> int:
    check_args(args)
    if args.tp == 1:
        return serve(args, bind(args.host, args.port))
    from .parallel.command import rank_of_this_command, run_ranked, shard_loaded
    from .runtime.runner import ModelRunner
    from .speed.load import load_model

    def load(group):  # every rank: the whole model, plain, then its shard with the fast paths
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, fast=False)
        return shard_loaded(model, group, fast=True), tokenizer

    sock = bind(args.host, args.port) if rank_of_this_command() == 0 else None  # before anything starts or loads
    # rank 0 serves; the other ranks make its engine's steps on their shards, as they are told
    return run_ranked(args.tp, args.device, lambda group, workers: serve(args, sock, load(group), group, workers),
                      lambda group: load(group)[0], ModelRunner)


def serve(args, sock, loaded=None, group=None, workers=None) -> int:
    """Load the model (or take `loaded`: rank 0's shard and the tokenizer), build the engine and the app, and serve
    on `sock` until Ctrl-C or SIGTERM."""
    import uvicorn

    from .speed.load import load_model

    model, tokenizer = loaded or load_model(args.model, dtype=args.dtype, device=args.device, quant=args.quant)
    name = args.served_model_name or args.model
    explain = str
    if group is not None:
        from .parallel.command import failed_rank

        explain = lambda error: str(failed_rank(workers, error))  # noqa: E731  (the rank that died, where known)
    runner, app, max_model_len = build_server(
        model, tokenizer, model_name=name, max_model_len=args.max_model_len, max_waiting=args.max_waiting,
        request_timeout=args.request_timeout, max_body_bytes=int(args.max_body_mb * 2**20),
        block_size=args.block_size, kv_cache_mb=args.kv_cache_mb, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, prefix_caching=not args.no_prefix_caching,
        graph="compiled" if args.compile else "eager" if args.eager else "auto", explain=explain)
    host, port = sock.getsockname()[:2]
    engine = runner.engine.runner
    built = "captured per bucket in" if model.device.type == "cuda" else "loaded or built in"
    path = (f"decode steps compiled ({built} {engine.build_seconds:.1f} s)" if engine.graph == "compiled"
            else f"eager, split over {group.world} processes ({group.backend})" if group is not None
            else "eager" + ("" if args.eager or model.device.type != "cpu" else
                            ": `python -m minillm.compile --serve` (same --model/--dtype/--quant/--block-size) builds "
                            "the compiled decode step once, and later starts load it"))
    print(f"minillm: serving {name!r} on http://{host}:{port}/v1 (max {max_model_len} tokens per request, "
          f"{args.max_num_seqs} at once; path: {path}; Ctrl-C stops)", file=sys.stderr, flush=True)
    # HTTP on a thread, the engine on this one (`AsyncEngine.run_here` says why: OpenMP runs a decode step at
    # half speed on a second thread). SIGTERM stops schema compiles under way (their requests get a 503) and ends
    # the engine's loop after its step; Ctrl-C interrupts it.
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=1))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="minillm-http", daemon=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: (app.state.openai.stop_compiling(), runner.stop_soon()))
    http.start()
    try:
        runner.run_here(keep_going=http.is_alive)
    finally:
        server.should_exit = True
        http.join(timeout=5)
    return 0


def main(argv=None) -> int:
    return run_command(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
