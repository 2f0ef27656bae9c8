"""The course's cost model: what a step should cost on this machine, predicted before it is measured.

`model.py` holds the arithmetic (bytes, flops, ops and syncs of a step, from the model's config) and
`probes.py` the four machine constants it needs, each measured by a probe of its own. Lessons and
benchmarks both import it; `python -m minillm.bench predict` writes its forecasts into results/.
"""
