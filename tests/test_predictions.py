"""The course's forecasts: made from probes alone, before the suites, judged against one band.

`python -m minillm.bench predict` (minillm/bench/predict.py) must not read results/, must state one
band no wider than 2.25x, and must name for each row the results file and the figure that will measure
it; `predicted_vs_measured.py` must compare a row only with a measurement made later on the same machine.
The stored forecast, where there is one, must predate every file it names and land 70% of at least 20
rows inside its band.
"""

from __future__ import annotations

import builtins
import datetime
import json
import math
from pathlib import Path

import pytest
import torch

from minillm.bench import figures, predict, predicted_vs_measured
from minillm.bench.cli import main as bench_main
from minillm.costmodel.model import SMOLLM2_135M, Machine, decode_step, predict as price

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
# Xeon-like constants, for the arithmetic only (nothing here is a measurement).
CURVE = ((1, 0.05e-9), (8, 0.08e-9), (64, 0.4e-9), (512, 3.0e-9))
MACHINE = Machine(30e9, 300e9, 2e-6, 0.2e-6, {"float32": CURVE, "bfloat16": CURVE})


def test_the_forecast_reads_nothing_from_results(monkeypatch):
    """No file is opened while the rows are priced: a forecast cannot lean on a stored run."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"the forecast opened {args[0]!r}")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(Path, "read_text", refuse)
    rows = predict.forecasts(MACHINE)
    assert len(rows) >= 20 and all(row["predicted"] > 0 for row in rows)


def test_one_band_for_the_course_no_wider_than_two_and_a_quarter():
    low, high = predict.BAND
    assert 0 < low < 1 < high and high / low <= 2.25


def test_every_row_names_a_figure_its_suite_stores():
    """Each row's expression reads a number from the results file it names (checked on the committed files)."""
    names = figures.results_names(RESULTS)
    for row in predict.forecasts(MACHINE):
        assert row["source"] in {p.stem for p in RESULTS.glob("*.json")}, row
        assert row["measured"].startswith(row["source"].replace("-", "_") + "."), row
        assert math.isfinite(float(figures.evaluate(row["measured"], names))), row


def test_the_library_curve_prices_eager_steps_and_the_roofline_compiled_ones():
    eager, compiled = (decode_step(SMOLLM2_135M, context=100, graph=graph) for graph in ("eager", "compiled"))
    plain = Machine(30e9, 300e9, 2e-6, 0.2e-6)
    assert price(compiled, MACHINE) == price(compiled, plain)  # generated kernels: the roofline
    weights = eager.weight_bytes * 0.05e-9  # one row: the curve's first point, head included
    assert price(eager, MACHINE) == pytest.approx(weights + max(eager.kv_bytes + eager.activation_bytes, 0) / 30e9
                                                  + eager.ops * 2e-6 + eager.syncs * 0.2e-6, rel=0.02)
    assert MACHINE.linear_seconds_per_byte("float32", 2) == pytest.approx(0.05e-9 * (0.08 / 0.05) ** (1 / 3))
    assert MACHINE.linear_seconds_per_byte("float32", 1024) == pytest.approx(6.0e-9)  # past the curve: compute


def test_an_eager_step_prices_its_head_and_its_attention_by_their_own_probes():
    """The LM head at its own curve and rows, and one attention call per layer at the probed speed for the
    step's batch, new tokens and keys, in place of the cache's bytes at the bandwidth."""
    attention = {(1, 1): ((64, 20e-6), (1024, 200e-6)), (8, 1): ((64, 100e-6), (1024, 1000e-6)),
                 (1, 4): ((64, 30e-6), (1024, 300e-6))}
    machine = Machine(30e9, 300e9, 2e-6, 0.2e-6, {"float32": CURVE, "float32 head": ((1, 0.04e-9), (32, 0.5e-9))},
                      attention)
    step = decode_step(SMOLLM2_135M, batch=1, context=256)
    call = 20e-6 * (200 / 20) ** 0.5  # 256 keys: halfway from 64 to 1024 in log
    assert machine.attention_seconds(1, 1, 256) == pytest.approx(call)
    expected = ((step.weight_bytes - step.head_bytes) * 0.05e-9 + step.head_bytes * 0.04e-9 + 30 * call
                + step.activation_bytes / 30e9 + step.ops * 2e-6 + step.syncs * 0.2e-6)
    assert price(step, machine) == pytest.approx(expected)
    assert machine.attention_seconds(16, 1, 64) == pytest.approx(200e-6)  # twice the rows of batch 8
    assert machine.attention_seconds(1, 3, 64) == pytest.approx(60e-6)  # three times the one new token probed
    assert machine.attention_seconds(1, 8, 64) is None  # more new tokens than any probed call
    assert machine.attention_seconds(1, 512, 512) is None  # a prefill: more than any probed call, priced by flops
    assert machine.linear_seconds_per_byte("bfloat16", 1, part="head") is None  # nothing probed for it


def test_the_dispatch_probe_runs_the_models_structure_with_nothing_to_compute():
    """`measure_op_seconds` times a decode step of a model with the config's layers, heads and switches at a tiny
    width: its step dispatches exactly the ops the cost model counts for the full model."""
    from minillm.costmodel.model import eager_ops
    from minillm.costmodel.probes import dispatch_model_config

    small = dispatch_model_config(SMOLLM2_135M)
    assert (small.n_layer, small.n_head, small.kv_heads, small.norm, small.mlp, small.positions) == (
        30, 9, 3, "rmsnorm", "swiglu", "rope")
    assert small.d_model * small.vocab_size < SMOLLM2_135M.d_model * SMOLLM2_135M.vocab_size / 1000
    assert eager_ops(small) == eager_ops(SMOLLM2_135M)


def test_a_compiled_step_prices_its_weights_by_the_compiled_kernels_at_one_row():
    """Generated kernels at their probed one-row speed, per format, the LM head at its own format's; more rows,
    or no probe for the format, fall back on the roofline."""
    linear = {"int4 compiled": ((1, 0.2e-9),), "int8 compiled": ((1, 0.08e-9),)}
    machine = Machine(30e9, 300e9, 2e-6, 0.2e-6, linear)
    step = decode_step(SMOLLM2_135M, context=96, bytes_per_weight=0.625, head_bytes_per_weight=1.0, graph="compiled",
                       dtype="int4", head_dtype="int8")
    expected = ((step.weight_bytes - step.head_bytes) * 0.2e-9 + step.head_bytes * 0.08e-9
                + max(step.kv_bytes / 30e9, step.attention_flops / 300e9) + step.activation_bytes / 30e9
                + step.ops * 2e-6 + step.syncs * 0.2e-6)
    assert price(step, machine) == pytest.approx(expected)
    plain = Machine(30e9, 300e9, 2e-6, 0.2e-6)
    batched = decode_step(SMOLLM2_135M, batch=4, context=96, graph="compiled", dtype="int4")
    assert price(batched, machine) == price(batched, plain)
    assert price(decode_step(SMOLLM2_135M, graph="compiled"), machine) == price(decode_step(SMOLLM2_135M,
                                                                                          graph="compiled"), plain)


@pytest.mark.slow
def test_the_compiled_probe_times_each_format_through_a_compiled_graph():
    """The probe's layers compute what the plain layers do (int8 and int4 within their rounding), and a compiled
    call of them gives one positive time per byte for each format asked."""
    from minillm.costmodel.probes import LinearsProbe, measure_compiled_rates, probe_layers

    torch.manual_seed(0)
    shapes = ((32, 64), (64, 32))
    x = [torch.randn(1, 32), torch.randn(1, 64)]
    for fmt in ("float32", "int8", "int4"):
        probe = LinearsProbe(probe_layers(fmt, shapes, copies=2))
        outputs = probe(*(t.to(torch.float32 if fmt == "float32" else torch.bfloat16) for t in x))
        assert [tuple(out.shape) for out in outputs] == [(1, 32), (1, 64)] * 2
    rates = measure_compiled_rates(shapes, formats=("float32", "int8"), copies=1, bursts=2, flush_bytes=2**20)
    assert set(rates) == {"float32 compiled", "int8 compiled"}
    assert all(rows == 1 and seconds > 0 for curve in rates.values() for rows, seconds in curve)


def stamped(suite: str, date: str, cpu: str = "Test CPU", **data) -> dict:
    return {"suite": suite, "date": date, "git": None, "command": f"python -m minillm.bench {suite}",
            "machine": {"cpu": cpu, "cores": 2, "memory_gib": 8.0, "cpu_flags": [], "torch_threads": 2,
                        "torch": "2.13.0+cpu", "python": "3.11", "device": "cpu"}, **data}


def write(folder: Path, name: str, data: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_a_row_is_compared_only_with_a_later_measurement_on_the_same_machine(tmp_path):
    rows = [{"lesson": "07", "what": f"decode at batch {b}", "unit": "tok/s", "predicted": 100.0, "source": source,
             "measured": f"{source}.rows.find(batch={b}).tok_s"}
            for b, source in ((1, "batch"), (2, "batch"), (4, "earlier"), (8, "elsewhere"), (16, "missing"))]
    write(tmp_path, "predictions", stamped("predict", "2026-01-02T00:00:00+00:00", band=[0.67, 1.5], rows=rows))
    write(tmp_path, "batch", stamped("batch", "2026-01-03T00:00:00+00:00",
                                     rows=[{"batch": 1, "tok_s": 120.0}, {"batch": 2, "tok_s": 40.0}]))
    write(tmp_path, "earlier", stamped("earlier", "2026-01-01T00:00:00+00:00", rows=[{"batch": 4, "tok_s": 100.0}]))
    write(tmp_path, "elsewhere", stamped("elsewhere", "2026-01-03T00:00:00+00:00", cpu="Other CPU",
                                         rows=[{"batch": 8, "tok_s": 100.0}]))
    data = predicted_vs_measured.verdicts(tmp_path)
    assert [r["verdict"] for r in data["rows"]] == ["inside", "outside", predicted_vs_measured.EARLIER,
                                                   predicted_vs_measured.ELSEWHERE, predicted_vs_measured.NOT_MEASURED]
    assert data["rows"][0]["ratio"] == pytest.approx(1.2) and data["rows"][1]["missing_term"]
    assert (data["compared"], data["inside"], data["inside_share"]) == (2, 1, 0.5)
    table = predicted_vs_measured.table(data["rows"])
    assert "inside" in table and "outside: " in table and "measured before the forecast" in table
    before = predicted_vs_measured.table(data["rows"], measured=False)  # what a notebook prints before measuring
    assert "decode at batch 16" in before and "120.00" not in before and "inside" not in before
    assert "2026-01-02 00:00 UTC" in predicted_vs_measured.forecast_note(tmp_path)


def test_report_writes_the_verdicts_and_check_notices_a_stale_file(tmp_path, capsys):
    rows = [{"lesson": "07", "what": "decode at batch 1", "unit": "tok/s", "predicted": 100.0, "source": "batch",
             "measured": "batch.rows.find(batch=1).tok_s"}]
    write(tmp_path, "predictions", stamped("predict", "2026-01-02T00:00:00+00:00", band=[0.67, 1.5], rows=rows))
    write(tmp_path, "batch", stamped("batch", "2026-01-03T00:00:00+00:00", rows=[{"batch": 1, "tok_s": 90.0}]))
    from minillm.bench import report

    assert report.rewrite_verdicts(tmp_path, check=True) == 1  # not written yet
    assert report.rewrite_verdicts(tmp_path, check=False) == 0
    assert report.rewrite_verdicts(tmp_path, check=True) == 0
    stored = json.loads((tmp_path / "predicted-vs-measured.json").read_text())
    assert stored["rows"][0]["verdict"] == "inside" and stored["inside"] == 1
    assert (tmp_path / "predicted-vs-measured.png").stat().st_size > 0  # the verdicts drawn
    write(tmp_path, "batch", stamped("batch", "2026-01-03T00:00:00+00:00", rows=[{"batch": 1, "tok_s": 20.0}]))
    assert report.rewrite_verdicts(tmp_path, check=True) == 1


@pytest.mark.slow
def test_predict_probes_the_machine_and_writes_its_rows(tmp_path):
    """The real command, quick probes: one band, at least 20 rows, the constants it priced them with."""
    assert bench_main(["predict", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "predictions.json").read_text())
    assert data["band"] == list(predict.BAND) and len(data["rows"]) >= 20
    machine = predict.machine_of(data)
    assert machine.bandwidth > 1e9 and machine.peak_flops > 1e9
    assert set(machine.linear) == {"float32", "bfloat16", "float32 head", "bfloat16 head"}
    assert (1, 1) in machine.attention and all(s > 0 for curve in machine.attention.values() for _, s in curve)
    again = predict.forecasts(machine)  # the constants as stored (in µs and ns) price the same rows, to rounding
    assert [{**row, "predicted": None} for row in again] == [{**row, "predicted": None} for row in data["rows"]]
    assert [row["predicted"] for row in again] == pytest.approx([row["predicted"] for row in data["rows"]], rel=1e-9)
    assert datetime.datetime.fromisoformat(data["date"])


STORED = RESULTS / "predictions.json"


NO_FORECAST = pytest.mark.skipif(not STORED.exists(), reason="no stored forecast yet: the next full run on the "
                                 "course's machine starts with `python -m minillm.bench predict`")


@NO_FORECAST
def test_the_stored_forecast_predates_every_measurement_it_names():
    forecast = json.loads(STORED.read_text())
    made = datetime.datetime.fromisoformat(forecast["date"])
    for source in {row["source"] for row in forecast["rows"]}:
        measured = json.loads((RESULTS / f"{source}.json").read_text())["date"]
        assert datetime.datetime.fromisoformat(measured) > made, f"results/{source}.json predates the forecast"
    data = predicted_vs_measured.verdicts(RESULTS)
    assert len(forecast["rows"]) >= 20 and data["compared"] == len(forecast["rows"])


@NO_FORECAST
def test_the_stored_forecast_mostly_holds():
    data = predicted_vs_measured.verdicts(RESULTS)
    assert data["inside_share"] >= 0.7, predicted_vs_measured.table(data["rows"])
