"""The persistent compile cache is on by default, and a second identical run loads the step and the
state initialiser from it instead of compiling them (issue 16, item 3)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from alpa_job.engines import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One fresh process = one "run": build the JAX engine for a small GPT, compile, init, one step.
RUN = textwrap.dedent("""
    import json, time
    t0 = time.perf_counter()
    import jax
    from alpa_job.config import JobConfig
    from alpa_job.data import epoch_batches, synthetic
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model
    config = JobConfig(model="gpt", num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=128,
                       num_samples=8, batch_size=8, steps=1, address="none").validated()
    batch, _ = next(epoch_batches(synthetic(config), 8, "drop", 0, 0))
    engine = JaxEngine(config, get_model(config), batch, "data", (len(jax.devices()), 1))
    engine.compile()
    state = engine.init_state(0)
    state, loss = engine.step(state, engine.put_batch(batch))
    s = engine.stats
    print(json.dumps({"dir": s.compile_cache_dir, "hits": s.compile_cache_hits, "loss": float(loss),
                      "compile_s": s.compile_seconds, "init_compile_s": s.init_compile_seconds,
                      "first_step_s": time.perf_counter() - t0}))
""")


def _run(cache_home: str) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=cache_home, PYTHONPATH=REPO,
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_identical_run_loads_step_and_init_from_the_default_cache(tmp_path):
    cold = _run(str(tmp_path))
    expected = os.path.join(str(tmp_path), "alpa_job", "jax")
    assert cold["dir"] == expected  # on by default, under the user's cache folder
    assert cold["hits"] == 0 and os.listdir(expected), "the cold run must write the cache"
    assert cold["init_compile_s"] is not None and cold["init_compile_s"] > 0  # init is compiled and counted

    warm = _run(str(tmp_path))
    assert warm["hits"] >= 2, warm  # the train step and the state initialiser both came from the cache
    assert warm["loss"] == cold["loss"]  # the same executable computes the same thing
    assert warm["compile_s"] < cold["compile_s"], (cold, warm)


def test_compile_cache_setting_resolves(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.resolve(None) == os.path.join(str(tmp_path), "alpa_job", "jax")
    assert compile_cache.resolve("") == compile_cache.resolve(None)
    assert compile_cache.resolve("none") is None and compile_cache.resolve("OFF") is None
    assert compile_cache.resolve("relative/dir") == os.path.abspath("relative/dir")
