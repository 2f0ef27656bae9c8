"""`python -m minillm.export`: write a model as ONNX graphs and run them (lesson 15; the export is built in
`minillm.speed.export`, the loaded graphs in `minillm.speed.onnx_model`, run by `generate` like any model)."""

from __future__ import annotations

import argparse
import sys

from .base.commands import OneLineParser, add_model_flags, run_command
from .speed.export import check_sizes, export_onnx
from .speed.onnx_model import OnnxModel
from .strategies.generate import generate

EPILOG = """examples:
  python -m minillm.export onnx --out exports/smollm2                 # default model, float32, context 512
  python -m minillm.export onnx --out exports/smollm2-long --context 2048 --chunk 128
  python -m minillm.export run exports/smollm2 --prompt "What is the capital of France?"
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillm.export", description="Export a minillm model to ONNX and run it "
                      "with onnxruntime.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    e = sub.add_parser("onnx", help="write prefill.onnx and decode.onnx for a fixed context length")
    add_model_flags(e, device=False, model_help="the model to export, as for python -m minillm.infer (default: "
                    "SmolLM2-135M-Instruct)", dtype_help="weights and compute precision: float32 (default) or "
                    "bfloat16 (for runtimes with BF16 kernels: onnxruntime's CPU provider lacks some, and refuses "
                    "such graphs)")
    e.add_argument("--out", required=True, metavar="DIR",
                   help="folder to write (replaced only once the new export is complete)")
    e.add_argument("--context", type=int, default=512, metavar="N",
                   help="tokens the KV cache holds: prompt plus generated tokens can never exceed it; attention "
                        "reads all N columns every step, so larger is slower (default 512)")
    e.add_argument("--chunk", type=int, default=64, metavar="N",
                   help="tokens per prefill step: prompts go through in chunks of N (default 64)")
    r = sub.add_parser("run", help="generate with an exported model through onnxruntime")
    r.add_argument("folder", metavar="DIR", help="a folder written by `python -m minillm.export onnx`")
    r.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt (wrapped in the chat template "
                   "when the model has one, unless --no-chat)")
    r.add_argument("--no-chat", action="store_true", help="feed the prompt as plain text, for completion")
    r.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="at most N new tokens (default 128)")
    r.add_argument("--threads", type=int, metavar="N", help="onnxruntime threads (default: one per core)")
    return p


def run(args) -> int:
    if args.command == "onnx":
        from .model.loading import resolve_checkpoint_folder
        from .speed.load import load_model

        check_sizes(args.context, args.chunk)
        model, _ = load_model(args.model, dtype=args.dtype, fast=False)
        out = export_onnx(model, args.out, args.context, args.chunk, model_name=args.model,
                          checkpoint=resolve_checkpoint_folder(args.model))
        print(f"wrote {out} (prefill T={args.chunk}, decode T=1, context {args.context})")
        return 0
    exported = OnnxModel(args.folder, threads=args.threads)
    text, tokenizer = args.prompt, exported.tokenizer
    if not args.no_chat and getattr(tokenizer, "chat_template", None) is not None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    for event in generate(exported, text, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens, stream=True):
        print(event.text, end="", flush=True)
    print()
    return 0


def main(argv=None) -> int:
    """Every failure is one line on stderr with exit status 2, as for `python -m minillm`."""
    return run_command(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
