"""The `cli` suite's llama.cpp contender: one process that loads a GGUF and streams greedy tokens, importing no torch.

Run by path (`python minillm/bench/llama_child.py GGUF N PROMPT THREADS`), not as
`python -m minillm.bench...`: importing the package imports torch, about a second and a
half the C++ engine's users never pay, which would be charged to llama.cpp's start.
So this file imports nothing from minillm, and nothing but llama-cpp-python.
"""

import os
import sys
import time

# Run by path, Python puts this file's folder first on sys.path, where minillm's own `llama_cpp.py` (the suites'
# helper) would shadow llama-cpp-python's package of the same name: that folder goes.
sys.path = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.dirname(os.path.abspath(__file__))]


def main(gguf: str, new_tokens: int, prompt: str, threads: int) -> None:
    """Stream `new_tokens` greedy tokens after `prompt` to stdout; report on stderr, in the words of the line
    `python -m minillm.infer --stats` prints, which the suite parses for both: the time from the prompt to the first
    token (its prefill, the model loaded) and the decode rate after it."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False,
                use_extra_bufts=False)
    start, times = time.perf_counter(), []
    for chunk in llm.create_completion(prompt, max_tokens=new_tokens, temperature=0, stream=True):
        times.append(time.perf_counter())
        sys.stdout.write(chunk["choices"][0]["text"])
        sys.stdout.flush()
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    print(f"[time to first token {times[0] - start:.3f} s, {len(times) - 1} decode tokens at {rate:.1f} tok/s]",
          file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
