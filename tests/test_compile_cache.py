"""The persistent compile cache is on by default, and a second identical run loads the step (from the
kit's store, without tracing) and the state initialiser (from JAX's cache) instead of compiling them
(issue 16, item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from alpa_job.cpu_devices import with_device_count
from alpa_job.engines import compile_cache, executable_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One fresh process = one "run": build the JAX engine for a small GPT, compile, init, one step.
RUN = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import jax
    from alpa_job.settings.config import JobConfig
    from alpa_job.data import epoch_batches, synthetic
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model
    config = JobConfig(model="gpt", model_args=dict(num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=128),
                       num_samples=8, batch_size=8, steps=1, address="none", **json.loads(sys.argv[1])).validated()
    batch, _ = next(epoch_batches(synthetic(config), 8, "drop", 0, 0))
    engine = JaxEngine(config, get_model(config), batch, "data", (len(jax.devices()), 1))
    engine.compile()
    state = engine.init_state(config.seed)
    state, loss = engine.step(state, engine.put_batch(batch))
    engine.finish("")
    s = engine.stats
    print(json.dumps({"dir": s.compile_cache_dir, "hits": s.compile_cache_hits, "loss": float(loss), "step": s.step_source,
                      "compile_s": s.compile_seconds, "init_compile_s": s.init_compile_seconds,
                      "first_step_s": time.perf_counter() - t0}))
""")


def _run(cache_home: str, **settings) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=cache_home, PYTHONPATH=REPO, XLA_FLAGS=with_device_count(2))
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(settings)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def _stored(cache_home: str) -> list:
    folder = os.path.join(cache_home, "alpa_job", "jax", executable_store.FOLDER)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _train(out: str, *args: str):
    """`python -m alpa_job train --address none ARGS --out OUT`: (its report, what it printed); it must succeed."""
    cmd = [sys.executable, "-m", "alpa_job", "train", "--address", "none", *args, "--out", out]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "report.json")) as f:
        return json.load(f), proc.stderr + proc.stdout


def test_second_identical_run_loads_the_stored_step_and_the_initialiser_from_the_default_cache(tmp_path):
    cold = _run(str(tmp_path))
    expected = os.path.join(str(tmp_path), "alpa_job", "jax")
    assert cold["dir"] == expected  # on by default, under the user's cache folder
    assert cold["hits"] == 0 and cold["step"] == "compiled"
    assert cold["init_compile_s"] is not None and cold["init_compile_s"] > 0  # init is compiled and counted
    assert [name.rsplit(".", 1)[1] for name in _stored(str(tmp_path))] == ["json", "xla"]

    warm = _run(str(tmp_path))
    assert warm["step"] == "stored", warm  # the step: loaded without tracing (engines/executable_store.py)
    assert warm["hits"] >= 3, warm  # shell, block and optimizer-state initialisers: JAX's cache
    assert warm["loss"] == cold["loss"]  # the same executable computes the same thing
    assert warm["compile_s"] < cold["compile_s"], (cold, warm)


def test_a_setting_that_reaches_the_step_compiles_anew_and_one_that_does_not_reuses_it(tmp_path):
    home = str(tmp_path)
    first = _run(home)
    other_rate = _run(home, learning_rate=2e-3)
    assert other_rate["step"] == "compiled" and len(_stored(home)) == 4  # a second entry beside the first
    other_seed = _run(home, seed=7)
    assert other_seed["step"] == "stored" and len(_stored(home)) == 4  # the seed only changes the state
    assert other_seed["loss"] != first["loss"]


def test_an_unreadable_entry_is_deleted_and_the_step_compiled(tmp_path):
    home = str(tmp_path)
    _run(home)
    folder = os.path.join(home, "alpa_job", "jax", executable_store.FOLDER)
    entry = [n for n in _stored(home) if n.endswith(".xla")][0]
    with open(os.path.join(folder, entry), "wb") as f:
        f.write(b"not an executable")
    broken = _run(home)
    assert broken["step"] == "compiled" and "could not be loaded" in broken["stderr"]
    assert _run(home)["step"] == "stored"  # rewritten by the run that compiled


def test_cli_second_identical_run_trains_the_same_from_the_stored_step(tmp_path):
    def train(out: str) -> dict:
        return _train(
            out,
            "--model",
            "gpt",
            "--num-layers",
            "2",
            "--d-model",
            "64",
            "--num-heads",
            "4",
            "--seq-len",
            "32",
            "--vocab-size",
            "128",
            "--num-samples",
            "64",
            "--batch-size",
            "8",
            "--steps",
            "6",
            "--compile-cache",
            str(tmp_path / "cache"),
        )[0]

    cold, warm = train(str(tmp_path / "cold")), train(str(tmp_path / "warm"))
    cold_cache, warm_cache = (r["timing"]["compile_cache"] for r in (cold, warm))
    assert cold_cache["step"] == "compiled" and warm_cache["step"] == "stored", (cold_cache, warm_cache)
    assert warm_cache["loaded_ahead"] is True  # deserialised while the engine built the model's abstract state
    assert warm["losses"] == cold["losses"] and len(warm["losses"]) == 6  # every step, bit for bit
    assert cold["backend_compiles_during_loop"] == warm["backend_compiles_during_loop"] == 0


def test_compile_cache_setting_resolves(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.resolve(None) == os.path.join(str(tmp_path), "alpa_job", "jax")
    assert compile_cache.resolve("") == compile_cache.resolve(None)
    assert compile_cache.resolve("none") is None and compile_cache.resolve("OFF") is None
    assert compile_cache.resolve("relative/dir") == os.path.abspath("relative/dir")


def test_a_second_identical_auto_run_reuses_the_search_and_loads_its_winner(tmp_path):
    """The first auto run compiles every candidate together and keeps its table and its winner's step
    beside the compile cache; an identical second run searches nothing: it loads the winner's step."""

    def search(out: str):
        return _train(
            out,
            "--model",
            "mlp",
            "--hidden-dim",
            "32",
            "--num-samples",
            "64",
            "--batch-size",
            "16",
            "--steps",
            "2",
            "--strategy",
            "auto",
            "--auto-trial-steps",
            "1",
            "--compile-cache",
            str(tmp_path / "cache"),
        )

    first, _ = search(str(tmp_path / "a"))
    timed = [row for row in first["search"] if row.get("step_time_s")]
    assert len(timed) >= 2, first["search"]
    # No candidate's step went into JAX's cache (writing the losers only lengthens the search).
    assert not [n for n in os.listdir(str(tmp_path / "cache")) if "train_step" in n]
    assert first["timing"]["compile_cache"]["step"] == "compiled"
    second, log = search(str(tmp_path / "b"))
    assert "reusing the search" in log, log[-2000:]
    assert second["strategy"] == first["strategy"] and second["mesh"] == first["mesh"]
    assert second["timing"]["compile_cache"]["step"] == "stored"  # no tracing, no compile
    assert all("from the saved search" in row["note"] for row in second["search"])
    saved = os.listdir(os.path.join(str(tmp_path / "cache"), "auto-search"))
    assert len(saved) == 1 and saved[0].endswith(".json")


def test_auto_never_keeps_a_winner_jax_loaded_from_its_own_cache(tmp_path):
    """An older kit wrote auto's candidate steps into JAX's cache under one shared name. A candidate JAX
    then loads from there, re-serialised as the kept winner, fails to run when loaded (XLA:CPU: "Function
    ... not found"). Candidates are named after their own key, so such entries never match: with one
    written for every candidate, a search and the run that reuses it both train."""
    cache = str(tmp_path / "cache")
    flags = [
        "--model",
        "mlp",
        "--hidden-dim",
        "32",
        "--num-samples",
        "64",
        "--batch-size",
        "16",
        "--auto-trial-steps",
        "1",
        "--compile-cache",
        cache,
    ]
    old_kit_entries = r"""
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, %r)
from alpa_job.cpu_devices import ensure_cpu_devices; ensure_cpu_devices(8)
import jax
from alpa_job.settings.config import JobConfig
from alpa_job.models import get_model
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.engines.optimizer import schedule_steps
from alpa_job.strategies import auto_candidates
from alpa_job.train.loop import prepare_data
config = JobConfig(model="mlp", model_args={"hidden_dim": 32}, num_samples=64, batch_size=16, steps=2, strategy="auto",
                   auto_trial_steps=1, compile_cache=%r, address="none").validated()
model = get_model(config)
data = prepare_data(config, model)
for strategy, mesh in auto_candidates(8):
    engine = JaxEngine(config, model, data.example, strategy, mesh,
                       schedule_steps=schedule_steps(config, data.epoch.steps))
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=engine.batch_sharding) for k, v in data.example.items()}
    engine._lower("train_step", abstract)[1].compile()  # the older kit's name, written to JAX's cache
print("written", len([n for n in os.listdir(%r) if n.startswith("jit_train_step-")]))
""" % (REPO, cache, cache)
    proc = subprocess.run([sys.executable, "-c", old_kit_entries], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "written" in proc.stdout, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 3, proc.stdout

    first, second = (_train(str(tmp_path / run), "--strategy", "auto", "--steps", "2", *flags)[0] for run in "ab")
    assert second["timing"]["compile_cache"]["step"] == "stored"  # the kept winner loaded, and it ran
    assert second["losses"] == first["losses"] and len(second["losses"]) == 2


def test_a_step_with_a_custom_partitioned_op_on_several_devices_is_stored_and_loaded(tmp_path):
    """cuDNN's attention is a custom-partitioned op: on several devices JAX keeps its partitioning callbacks with
    the executable, and jax's own serialisation cannot pickle them (multi-GPU GPT and LLaMA steps were never
    stored). The store leaves them out; the loaded step computes the same."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import serialize_executable
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.sharding import NamedSharding, PartitionSpec

    from alpa_job.engines.device_mesh import make_mesh

    @custom_partitioning
    def double(x):
        return x * 2

    def partition(mesh, arg_shapes, result_shape):
        sharding = arg_shapes[0].sharding
        return mesh, lambda x: x * 2, sharding, (sharding,)

    def infer(mesh, arg_shapes, result_shape):
        return arg_shapes[0].sharding

    double.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule="i -> i")
    sharding = NamedSharding(make_mesh((len(jax.devices()), 1), ("data", "model")), PartitionSpec("data"))
    x = jax.device_put(jnp.arange(16.0), sharding)
    compiled = jax.jit(lambda x: double(x) + 1, in_shardings=sharding, out_shardings=sharding).lower(x).compile()
    with pytest.raises(AttributeError, match="pickle"):
        serialize_executable.serialize(compiled)  # why the store does not call it as it is
    store = executable_store.StepStore(str(tmp_path), {"step": "custom-partitioned"})
    store.save_in_background(compiled, {})
    store.wait()
    loaded, _ = store.load(jax.tree_util.tree_structure(((x,), {})), jax.tree_util.tree_structure(x))
    assert list(loaded(x)) == list(compiled(x)) == [2.0 * i + 1 for i in range(16)]
