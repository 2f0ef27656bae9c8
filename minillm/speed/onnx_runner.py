"""Generate with an exported model (`minillm.speed.export`) through onnxruntime: chunked prefill, then one token per step.

The runner owns what the decode session owns in PyTorch: the KV cache (here the
graphs' `present_*` outputs, fed back as the next step's `past_*` inputs, never
copied out of onnxruntime) and the positions. Token choice, stopping and streaming
are the package's own (`minillm.decoding.sampling`, `minillm.decoding.stopping`,
`minillm.decoding.outputs`): the runner yields the same `GenerationEvent`s as
`generate(..., stream=True)` and returns the same `GenerationOutput`.

A prompt goes through the prefill graph `chunk` tokens at a time. A prompt shorter
than one chunk is padded on the right: the padding takes the next positions and
writes columns that the first generated tokens overwrite before anything attends
to them. A longer prompt's last chunk is instead the prompt's last `chunk`
tokens: it recomputes a few keys already written (the same values), so no
padding is needed near the end of the context.

    runner = OnnxRunner("exports/smollm2")
    for event in runner.generate("Once upon a time", max_new_tokens=32, stream=True):
        print(event.text, end="")
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from ..base.jsonio import read_json
from ..decoding.outputs import GenerationEvent, GenerationOutput, GenerationStats, RowOutput, drain, encode_prompts
from ..decoding.sampling import SamplingConfig, TokenHistory, choose_rows, generators_for, process_rows
from ..decoding.stopping import RowState
from ..model.tokenizer import tokenizer_from_folder

FORMAT = 1  # manifest layout; a runner refuses exports of another format
MANIFEST, WEIGHTS = "manifest.json", "weights.data"
GRAPHS = {"prefill": "prefill.onnx", "decode": "decode.onnx"}
ONNX_DTYPES = {"float32": 1, "bfloat16": 16, "float16": 10}  # onnx.TensorProto element types


def input_names(n_layer: int) -> list[str]:
    return (["input_ids", "position_ids"] + [f"past_key.{i}" for i in range(n_layer)]
            + [f"past_value.{i}" for i in range(n_layer)])


def output_names(n_layer: int) -> list[str]:
    return ["logits"] + [f"present_key.{i}" for i in range(n_layer)] + [f"present_value.{i}" for i in range(n_layer)]


class ExportError(ValueError):
    """An export folder that cannot be run as it is; the message says how to make one that can."""


class OnnxRunner:
    """The two graphs of one export, loaded into onnxruntime, with the export's tokenizer."""

    def __init__(self, folder: str | Path, threads: int | None = None):
        import onnxruntime as ort

        self.folder = folder = Path(folder)
        again = f"export again: python -m minillm.export onnx --out {folder}"
        if not (folder / MANIFEST).is_file():
            raise ExportError(f"{folder} holds no {MANIFEST}: it is not a minillm ONNX export; {again}")
        self.manifest = m = read_json(folder / MANIFEST)
        if m.get("format") != FORMAT:
            raise ExportError(f"{folder} was written in export format {m.get('format')}, this runner reads "
                              f"{FORMAT}: {again}")
        for name in (*GRAPHS.values(), WEIGHTS):
            if not (folder / name).is_file():
                raise ExportError(f"{folder / name} is missing: {again}")
        self.context, self.chunk, self.n_layer = m["context"], m["chunk"], m["n_layer"]
        self.vocab_size = m["vocab_size"]
        self.kv_shape = (1, m["n_kv_head"], self.context, m["head_dim"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.log_severity_level = 3  # errors only
        self.sessions = {}
        for kind, name in GRAPHS.items():
            try:
                session = ort.InferenceSession(str(folder / name), options, providers=["CPUExecutionProvider"])
            except Exception as e:  # onnxruntime raises its own exception types, one per failure kind
                message = " ".join(str(e).split())
                fix = (f"this onnxruntime has no {m['dtype']} kernel for one of its ops: export with --dtype float32"
                       if "NOT_IMPLEMENTED" in message else again)
                raise ExportError(f"onnxruntime cannot load {folder / name} ({message[:200]}): {fix}") from None
            self.check_graph(session, kind, again)
            self.sessions[kind] = session
        self.tokenizer = tokenizer_from_folder(folder, m.get("model_type", ""))
        self.onnx_dtype = ONNX_DTYPES[m["dtype"]]

    def check_graph(self, session, kind: str, again: str) -> None:
        """The graph belongs to this export and has the shapes the manifest promises."""
        path = self.folder / GRAPHS[kind]
        export_id = session.get_modelmeta().custom_metadata_map.get("minillm.export_id")
        if export_id != self.manifest["export_id"]:
            raise ExportError(f"{path} comes from another export than {self.folder / MANIFEST} "
                              f"(export id {export_id}, manifest {self.manifest['export_id']}): {again}")
        tokens = self.chunk if kind == "prefill" else 1
        expected = {"input_ids": [1, tokens], "position_ids": [1, tokens], "past_key.0": list(self.kv_shape)}
        shapes = {i.name: i.shape for i in session.get_inputs()}
        for name, shape in expected.items():
            if shapes.get(name) != shape:
                raise ExportError(f"{path}: input {name} has shape {shapes.get(name)}, the manifest implies "
                                  f"{shape}: {again}")

    # ------------------------------------------------------------------ the two graphs

    def empty_cache(self) -> list:
        """Zeroed past keys and values (zeros, not uninitialised memory: a masked column's key still meets
        the query in a product, and a NaN there would survive the mask)."""
        import onnxruntime as ort

        zeros = np.zeros(self.kv_shape, dtype=np.float32 if self.onnx_dtype == 1 else np.uint16)
        return [ort.OrtValue.ortvalue_from_numpy_with_onnx_type(zeros.copy(), self.onnx_dtype)
                for _ in range(2 * self.n_layer)]

    def step(self, kind: str, tokens: list[int], start: int, cache: list) -> tuple[np.ndarray, list]:
        """Run one graph on tokens at positions start, start + 1, ...; logits [T, V] and the new cache."""
        session = self.sessions[kind]
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", np.array([tokens], dtype=np.int64))
        binding.bind_cpu_input("position_ids", np.arange(start, start + len(tokens), dtype=np.int64)[None])
        for name, value in zip(input_names(self.n_layer)[2:], cache):
            binding.bind_ortvalue_input(name, value)
        for name in output_names(self.n_layer):
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy()[0], outputs[1:]

    def prefill(self, ids: list[int]) -> tuple[np.ndarray, list]:
        """The prompt through the prefill graph, chunk by chunk: next-token logits [V] and the cache."""
        C, cache = self.chunk, self.empty_cache()
        if len(ids) <= C:  # one chunk, padded with copies of the last token at the next positions
            logits, cache = self.step("prefill", ids + ids[-1:] * (C - len(ids)), 0, cache)
            return logits[len(ids) - 1], cache
        starts = list(range(0, len(ids) - C, C)) + [len(ids) - C]  # the last chunk ends at the prompt's end
        for start in starts:
            logits, cache = self.step("prefill", ids[start : start + C], start, cache)
        return logits[-1], cache

    def generate(self, prompt, config: SamplingConfig | None = None, *, stream: bool = False, streamer=None,
                 **config_overrides):
        """Like `minillm.strategies.generate.generate` for one prompt: a GenerationOutput, or with stream=True the run to iterate."""
        run = OnnxGeneration(self, prompt, config, **config_overrides)
        return run if stream else drain(run, streamer)


class OnnxGeneration:
    """One prompt's run through the exported graphs: iterate it for events; `output` holds the result."""

    def __init__(self, runner: OnnxRunner, prompt, config: SamplingConfig | None = None, **config_overrides):
        rows = encode_prompts(prompt, runner.tokenizer)
        if len(rows) != 1:
            raise ValueError(f"{len(rows)} prompts given: the ONNX graphs were exported for batch 1; "
                             f"run one prompt at a time")
        self.runner, self.prompt_ids = runner, rows[0]
        config = config or SamplingConfig()
        self.config = config.with_(**config_overrides) if config_overrides else config
        n, wanted = len(self.prompt_ids), len(self.prompt_ids) + self.config.max_new_tokens
        if not n:
            raise ValueError("the prompt is empty: give it at least one token")
        if max(self.prompt_ids) >= runner.vocab_size or min(self.prompt_ids) < 0:
            raise ValueError(f"the prompt holds a token id outside the vocabulary [0, {runner.vocab_size})")
        if wanted > runner.context:
            raise ValueError(f"the prompt ({n} tokens) plus max_new_tokens ({self.config.max_new_tokens}) needs "
                             f"{wanted} positions but the exported graphs hold {runner.context}: export with "
                             f"--context {wanted} or more, or shorten the prompt or the output")
        if self.config.stop and runner.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: this export has none (tokenizer.json)")
        self.state = RowState.for_config(self.prompt_ids, self.config, runner.tokenizer)
        self.stats = GenerationStats(prompt_tokens=n)
        self.output: GenerationOutput | None = None

    @torch.inference_mode()
    def __iter__(self):
        runner, state, config = self.runner, self.state, self.config
        t_start = time.perf_counter()
        if state.finished:  # max_new_tokens == 0
            yield GenerationEvent(0, [], "", state.finish_reason)
        else:
            generators = generators_for([config])
            history = TokenHistory.from_prompts([self.prompt_ids], runner.vocab_size, None) \
                if config.uses_penalties else None
            logits, cache = runner.prefill(self.prompt_ids)
            position, t_first = len(self.prompt_ids), None
            while True:
                self.stats.forward_passes += 1
                scores = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))[None]  # [1, V]
                token = choose_rows(process_rows(scores, [config], history), [config], generators)  # [1]
                if history is not None:
                    history.add(token)
                state.push(int(token))
                if t_first is None:
                    t_first = time.perf_counter()
                    self.stats.prefill_seconds = t_first - t_start
                yield GenerationEvent(0, [int(token)], state.new_text(), state.finish_reason)
                if state.finished:
                    break
                logits, cache = runner.step("decode", [int(token)], position, cache)
                logits, position = logits[0], position + 1
            self.stats.decode_seconds = time.perf_counter() - t_first
        self.stats.decode_tokens = max(len(state.token_ids) - 1, 0)
        self.output = GenerationOutput([RowOutput.from_state(state)], self.stats)


__all__ = ["OnnxRunner", "OnnxGeneration", "ExportError", "GRAPHS", "MANIFEST", "WEIGHTS", "FORMAT",
           "input_names", "output_names"]
