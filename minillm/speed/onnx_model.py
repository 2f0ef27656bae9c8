"""An exported model (`minillm.speed.export`) in onnxruntime, run by the model runner like any other model.

`OnnxModel` loads an export's two graphs (prefill, decode) and its tokenizer and
checks them against the manifest. It is handed to `generate` (or any strategy built
on `minillm.runtime.runner.ModelRunner`) in place of a PyTorch model; the runner
then keeps its cache in an `OnnxSession`: the graphs' `present_*` outputs, fed back as
the next step's `past_*` inputs, never copied out of onnxruntime. Token choice,
stopping, streaming and the request's life are the package's own, so an export gives
the same tokens, events and outputs as the model it came from.

A prompt goes through the prefill graph `chunk` tokens at a time. A prompt shorter
than one chunk is padded on the right: the padding takes the next positions and
writes columns that the first generated tokens overwrite before anything attends
to them. A longer prompt's last chunk is instead the prompt's last `chunk`
tokens: it recomputes a few keys already written (the same values), so no
padding is needed near the end of the context. The graphs mask by position (a token
sees the columns up to its own), so forgetting tokens (a rejected draft) is only a
shorter row: their columns are overwritten before anything reads them.

    model = OnnxModel("exports/smollm2")
    for event in generate(model, "Once upon a time", tokenizer=model.tokenizer, max_new_tokens=32, stream=True):
        print(event.text, end="")
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..base.jsonio import read_json
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


class OnnxModel:
    """The two graphs of one export, loaded into onnxruntime, with the export's tokenizer."""

    device = torch.device("cpu")  # onnxruntime's CPU provider: inputs and logits live in host memory

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
        # What the runner and the request checks read of a model's config: the export's sizes
        self.config = SimpleNamespace(vocab_size=self.vocab_size, context_length=self.context, n_layer=self.n_layer)
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



class OnnxSession:
    """The decode session's verbs (`minillm.runtime.session`) for one row over an export's graphs.

    The cache is the list of onnxruntime values the last graph returned; a row's length
    is its next position. Several tokens after a prefill (a speculative draft) go through
    the decode graph one at a time: the same logits a wider graph would give.
    """

    def __init__(self, model: OnnxModel, max_len: int | None = None, max_batch: int = 1):
        if max_batch != 1:
            raise ValueError(f"{max_batch} rows asked for: the ONNX graphs were exported for batch 1; "
                             f"run one prompt at a time")
        if max_len is not None and max_len > model.context:
            raise ValueError(f"the prompt plus max_new_tokens needs {max_len} positions but the exported graphs "
                             f"hold {model.context}: export with --context {max_len} or more, or shorten the "
                             f"prompt or the output")
        self.model, self.max_len = model, model.context
        self.rows: list[list[int]] = []
        self.cache: list = []

    @staticmethod
    def _tensor(logits: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))

    def prefill(self, rows: list[list[int]]) -> torch.Tensor:
        """Start over with one prompt; next-token logits [1, V]."""
        if len(rows) != 1:
            raise ValueError(f"{len(rows)} prompts given: the ONNX graphs were exported for batch 1; "
                             f"run one prompt at a time")
        self.rows = [list(rows[0])]
        logits, self.cache = self.model.prefill(self.rows[0])
        return self._tensor(logits)[None]

    def extend(self, tokens, tree=None) -> torch.Tensor:
        """Feed T tokens after the row, one decode graph each; logits [1, T, V] after each."""
        if tree is not None:
            raise ValueError("the exported graphs take a chain of tokens, not a tree: verify a chain "
                             "(prompt lookup, a draft model) or run the PyTorch model")
        (row,) = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        logits = []
        for token in row:
            step_logits, self.cache = self.model.step("decode", [int(token)], len(self.rows[0]), self.cache)
            self.rows[0].append(int(token))
            logits.append(step_logits[0])
        return self._tensor(np.stack(logits))[None]

    def rollback(self, lengths: list[int]) -> None:
        """Forget the row's tokens past lengths[0]: the graphs mask by position, so this is only a length."""
        self.rows[0] = self.rows[0][: lengths[0]]

    def select(self, index) -> None:
        if [int(i) for i in index] != [0]:
            raise ValueError("the ONNX graphs hold one row: beams and batches need the PyTorch model")

    def keep_positions(self, row: int, positions: list[int]) -> None:
        raise ValueError("the exported graphs take a chain of tokens, not a tree: run the PyTorch model")


__all__ = ["OnnxModel", "OnnxSession", "ExportError", "GRAPHS", "MANIFEST", "WEIGHTS", "FORMAT",
           "input_names", "output_names"]
