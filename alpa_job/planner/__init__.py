"""`python -m alpa_job plan`: memory, communication and step time per strategy for a cluster you don't have.

- gpus.py: the GPU catalogue (memory, bf16 peak, NVLink) and a user-described GPU;
- candidates.py: the strategy x mesh candidates for N nodes x G GPUs and the batch;
- compile_plan.py: one candidate compiled on N x G emulated CPU devices (worker.py runs them in a
  subprocess whose device count is set before jax imports);
- placement.py: where each mesh axis runs (inside a node, across nodes); record/traffic.py reads each
  collective's replica groups and its bytes per link;
- estimate.py: step time from FLOPs and traffic, with constants fitted to calibration.json's measured runs;
- prefilter.py: the plan as a filter for `--strategy auto`'s candidates;
- render.py: the ranked table (terminal) and plan.html.
"""
