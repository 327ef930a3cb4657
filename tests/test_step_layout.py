"""Several devices: the profile of chosen steps, activations pinned by api.constrain, and fsdp's
outer-dimension split - on emulated CPU devices, through the real engine and CLI."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec

from alpa_job import api, cli, strategies
from alpa_job.engines import xla_options
from alpa_job.engines.jax_engine import resolve_spec
from alpa_job.record.trace_summary import collective_kind, summarise_events

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp_path, *extra, expect_ok=True):
    """A run of the CLI on a small GPT over 2 devices: in this process when it should train (the import and
    start-up of a process per run cost more than its training), in a fresh one when it should fail (its
    stderr and exit code are what the test reads)."""
    argv = [
        "train",
        "--address",
        "none",
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
        "--devices",
        "2",
        "--num-samples",
        "32",
        "--batch-size",
        "8",
        "--steps",
        "6",
        "--compile-cache",
        "none",
        "--out",
        str(tmp_path / "run"),
        *extra,
    ]
    if expect_ok:
        assert cli.main(argv) == 0
        return None
    cmd = [sys.executable, "-m", "alpa_job", *argv]
    return subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)


def test_profile_traces_the_named_steps_and_reports_their_communication(tmp_path):
    _train(tmp_path, "--strategy", "fsdp", "--profile", "3:2")
    with open(tmp_path / "run" / "report.json") as f:
        report = json.load(f)
    profile = report["timing"]["profile"]
    # fsdp's step compiled with its collective combine thresholds, and the loop never compiled it again.
    assert report["compiler_options"] == dict(strategies.FSDP.compiler_options)
    assert report["backend_compiles_during_loop"] == 0
    assert profile["steps"] == [3, 4]
    assert os.path.isfile(profile["trace"]) and profile["trace"].endswith(".trace.json.gz")
    assert [n for n in os.listdir(os.path.dirname(profile["trace"])) if n.endswith(".xplane.pb")]  # TensorBoard/XProf
    # fsdp over 2 devices gathers parameters and reduces gradients: the trace holds collectives.
    assert 0 < profile["comm_share"] <= 1 and 0 <= profile["exposed_comm_share"] <= profile["comm_share"]
    assert {"all-gather"} <= set(profile["collective_ms_per_step"])
    markdown = (tmp_path / "run" / "report.md").read_text()
    assert "communication share (profiled)" in markdown and profile["trace"] in markdown
    assert "xla_gpu_all_gather_combine_threshold_bytes=512" in markdown  # the summary names fsdp's options


@pytest.mark.parametrize("value", ["3", "0:2", "a:b", "3:0"])
def test_a_bad_profile_value_is_one_line_before_anything_runs(tmp_path, value):
    proc = _train(tmp_path, "--profile", value, expect_ok=False)
    assert proc.returncode == 2 and "--profile" in proc.stderr and "START:COUNT" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_exposed_communication_is_what_no_compute_covers():
    def span(pid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur}

    meta = {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}}
    # 0-100 compute; 50-150 all-reduce: 100 of comm, 50 of it exposed, over a 150 window of 1 step.
    out = summarise_events([meta, span(7, "gemm_fusion", 0, 100), span(7, "ncclDevKernel_AllReduce_Sum_bf16", 50, 100)], 1)
    assert out["platform"] == "gpu" and out["comm_share"] == round(100 / 150, 4)
    assert out["exposed_comm_share"] == round(50 / 150, 4)
    assert collective_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce-scatter"
    assert collective_kind("loop_add_fusion") is None


class _Mesh:
    shape = {"data": 2, "model": 1}


def test_fsdp_splits_the_outermost_named_dimension():
    rules = [("batch", "data"), ("embed", "data"), ("mlp", "data")]
    down = PartitionSpec("mlp", "embed")  # [mlp, embed]: the earliest rule (embed) would split the inner dim
    assert resolve_spec(down, (256, 64), rules, _Mesh()) == PartitionSpec(None, "data")
    assert resolve_spec(down, (256, 64), rules, _Mesh(), major_first=True) == PartitionSpec("data", None)
    # A dimension the mesh does not divide is skipped for the next one the rules name.
    assert resolve_spec(down, (255, 64), rules, _Mesh(), major_first=True) == PartitionSpec(None, "data")


def test_fsdp_combines_its_collectives_unless_the_user_set_the_threshold():
    options = xla_options.compiler_options("fsdp", xla_flags="")
    assert options["xla_gpu_all_gather_combine_threshold_bytes"] >= 2**28
    assert options["xla_gpu_reduce_scatter_combine_threshold_bytes"] >= 2**28
    assert xla_options.compiler_options("data", xla_flags="") == options  # its sharded update gathers too
    assert xla_options.compiler_options("tensor", xla_flags="") == {}
    mine = xla_options.compiler_options("fsdp", xla_flags="--xla_gpu_all_gather_combine_threshold_bytes=1 --xla_foo")
    assert set(mine) == {"xla_gpu_reduce_scatter_combine_threshold_bytes"}


def test_constrain_is_the_identity_outside_an_engine():
    marker = object()
    assert api.constrain(marker, (api.BATCH, api.EMBED)) is marker


def test_fsdp_gathers_parameters_not_activations():
    """Under fsdp no collective moves more than the largest parameter (fp32): activations stay split by
    rows, parameters are gathered to them (the model's api.constrain calls pin that)."""
    code = (
        r"""
import os, sys, json
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, %r)
from alpa_job.cpu_devices import ensure_cpu_devices; ensure_cpu_devices(2)
import jax, numpy as np
from alpa_job.settings.config import JobConfig
from alpa_job.models import get_model
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.record.hlo import collective_instances
# GPT 24L's widths (2 of its layers): at these sizes XLA, left alone, resharded activations (gigabytes a step).
config = JobConfig(model="gpt", model_args=dict(num_layers=2, d_model=2048, num_heads=16, seq_len=1024, vocab_size=32768),
                   batch_size=16, num_samples=16, dtype="bfloat16", address="none", compile_cache="none").validated()
model = get_model(config)
batch = {"tokens": np.zeros((16, 1025), np.int32), "mask": np.ones((16,), np.float32)}
engine = JaxEngine(config, model, batch, "fsdp", (2, 1))
stats = engine.compile_step()
largest = max(int(np.prod(l.shape)) * 4 for l in jax.tree_util.tree_leaves(engine.abstract_state.params))
print(json.dumps({"largest_param": largest,
                  "collectives": [[k, b] for k, _, b in collective_instances(stats.hlo_texts[0])]}))
"""
        % REPO
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    moved = [(kind, size) for kind, size in result["collectives"] if kind != "all-reduce"]
    assert moved and max(size for _, size in moved) <= result["largest_param"], result


def test_gpt_remat_trains_the_same_numbers(tmp_path):
    """--remat only changes what the backward keeps; params keep their names. The first loss (a forward) is the
    same bit for bit; later ones to rounding: a recomputed value may fuse differently, and on some CPUs (AMD EPYC
    without AVX-512) that moves the last digit after a few updates."""
    losses = {}
    for policy in ("none", "mlp-weights", "weights", "dots", "full"):
        out = tmp_path / policy
        _train(out, "--strategy", "fsdp", "--remat", policy)
        with open(out / "run" / "report.json") as f:
            report = json.load(f)
        losses[policy] = report["losses"]
        names = {leaf["path"].split("/")[1] for leaf in report["params"] if leaf["path"].startswith("params/")}
        assert {"DecoderBlock_0", "DecoderBlock_1", "wte"} <= names, names
    assert len({v[0] for v in losses.values()}) == 1, losses
    for policy, values in losses.items():
        assert np.allclose(values, losses["none"], rtol=2e-6, atol=0), (policy, losses)


def test_remat_dots_keeps_the_attention_output():
    """The `dots` policy keeps matmul outputs and the tagged attention output (its fused kernel is the costliest
    to rerun); the norms and GELU are recomputed."""
    saved = _saved_residuals("dots", "float32")
    assert any("named 'attention'" in s for s in saved), saved
    computed = [s for s in saved if "from the argument" not in s and "from a constant" not in s]
    assert computed and all("dot_general" in s or "named 'attention'" in s for s in computed), computed


def _saved_residuals(policy: str, dtype: str = "bfloat16"):
    """What the backward of one GPT block under `policy` keeps, one line per value (jax's own listing)."""
    import contextlib
    import io

    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import print_saved_residuals

    from alpa_job.models import gpt

    block = gpt.block_class(policy)(4, jnp.dtype(dtype), "einsum", policy)
    x = jnp.ones((2, 8, 16), jnp.dtype(dtype))
    params = block.init(jax.random.PRNGKey(0), x)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(lambda p: block.apply(p, x).astype(jnp.float32).sum(), params)
    return printed.getvalue().splitlines()


def test_remat_weights_keeps_activations_but_not_the_weights_bf16_copies():
    """`weights`: the backward keeps no bf16 copy of a kernel (it casts - under fsdp gathers - again from the
    fp32 parameter); `mlp-weights`: none of the MLP's; both keep every activation `none` keeps."""
    kernel_shapes = ("[16,3,4,4]", "[4,4,16]", "[16,64]", "[64,16]")

    def bf16_kernels(lines):
        return [s for s in lines if s.startswith("bf16") and s.split()[0][4:] in kernel_shapes]

    none, weights, mlp = _saved_residuals("none"), _saved_residuals("weights"), _saved_residuals("mlp-weights")
    assert len(bf16_kernels(none)) == 4, none
    assert bf16_kernels(weights) == [], weights
    assert sorted(s.split()[0][4:] for s in bf16_kernels(mlp)) == ["[16,3,4,4]", "[4,4,16]"], mlp  # attention's kept
    activations = [s.split()[0] for s in none if not bf16_kernels([s]) and "from the argument" not in s]
    for kept in (weights, mlp):
        assert activations and sorted(a for a in (s.split()[0] for s in kept) if a in activations) == sorted(activations)


def test_remat_weights_gathers_each_weight_again_under_fsdp():
    """Under fsdp with XLA placing the gathers, `weights` turns the forward's one all-gather per weight into two (forward and backward),
    `mlp-weights` only the MLP's, and no matmul is run again: the compiled step on 2 CPU devices shows it."""
    code = (
        r"""
import os, re, sys, json
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, %r)
from alpa_job.cpu_devices import ensure_cpu_devices; ensure_cpu_devices(2)
import numpy as np
from alpa_job.settings.config import JobConfig
from alpa_job.models import get_model
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.record.hlo import collective_instances
counts = {}
for remat in ("none", "mlp-weights", "weights"):
    config = JobConfig(model="gpt", model_args=dict(num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=128,
                       remat=remat), batch_size=8, num_samples=8, dtype="bfloat16", address="none",
                       compile_cache="none", fsdp_gather="xla").validated()
    batch = {"tokens": np.zeros((8, 33), np.int32), "mask": np.ones((8,), np.float32)}
    stats = JaxEngine(config, get_model(config), batch, "fsdp", (2, 1)).compile_step()
    hlo = stats.hlo_texts[0]
    counts[remat] = sum(1 for kind, _, _ in collective_instances(hlo) if kind == "all-gather")
    counts[remat + " dots"] = len(re.findall(r"= [a-z0-9\[\]{},]+ dot\(", hlo))
print(json.dumps(counts))
"""
        % REPO
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["none"] > 0 and counts["weights"] == counts["none"] + 8, counts  # 2 blocks x 4 kernels again
    assert counts["mlp-weights"] == counts["none"] + 4, counts  # 2 blocks x the MLP's 2 kernels
    # The matmul rerun inside each checkpoint is dead (the backward needs only its inputs) and dropped.
    assert counts["none dots"] == counts["mlp-weights dots"] == counts["weights dots"] > 0, counts


def test_data_shards_its_update_and_trains_the_same_numbers(tmp_path):
    """--data-update sharded (the default): parameters and optimizer state split over the data axis between
    steps, the compiled step gathers the parameters (in bf16 where the model reads them only in bf16), and
    every loss equals the replicated update's."""
    reports = {}
    for update in ("sharded", "replicated"):  # bf16's narrower gather: the resume test below compares the two
        _train(tmp_path / update, "--strategy", "data", "--data-update", update)
        with open(tmp_path / update / "run" / "report.json") as f:
            reports[update] = json.load(f)
    assert reports["sharded"]["losses"] == reports["replicated"]["losses"]

    def layout(report, prefix):
        return {leaf["strategy"] for leaf in report["params"] if leaf["path"].startswith(prefix) and leaf["shape"]}

    assert layout(reports["sharded"], "params/") == {"ZeRO"}
    assert layout(reports["sharded"], "opt_state/") == {"ZeRO"}
    assert layout(reports["replicated"], "params/") == layout(reports["replicated"], "opt_state/") == {"DP"}
    assert reports["replicated"]["collectives"]["all-gather"]["count"] == 0
    whole_fp32 = sum(leaf["bytes_per_device"] for leaf in reports["replicated"]["params"] if leaf["path"].startswith("params/"))
    # Every parameter gathered whole. (A bf16 model's narrower gather cannot show here: the CPU backend
    # widens bf16 collectives to f32. tests/test_weight_reads.py checks what the step gathers instead.)
    assert reports["sharded"]["collectives"]["all-gather"]["bytes"] >= whole_fp32
    state_bytes = {u: sum(leaf["bytes_per_device"] for leaf in r["params"]) for u, r in reports.items()}
    assert state_bytes["sharded"] < state_bytes["replicated"] / 1.9  # two devices: half of every leaf


def test_a_checkpoint_with_whole_parameters_resumes_into_datas_split_layout_with_the_same_losses(tmp_path):
    """A checkpoint whose parameters were saved whole (the replicated update, or a kit from before the sharded
    update split them) resumes under the sharded update, and trains on with the losses of an unbroken run. In
    bf16: the unbroken run gathers bf16 weights from the start, so equal losses also say that the bf16 gather
    computes what the replicated update computes."""
    common = ("--strategy", "data", "--dtype", "bfloat16", "--checkpoint-every", "3")
    _train(tmp_path / "broken", *common, "--data-update", "replicated")  # 6 steps, checkpoints at 3 and 6
    with open(tmp_path / "broken" / "run" / "report.json") as f:
        first_six = json.load(f)["losses"]
    _train(tmp_path / "broken", *common, "--steps", "10", "--resume")
    _train(tmp_path / "unbroken", *common, "--steps", "10")
    reports = {}
    for name in ("broken", "unbroken"):
        with open(tmp_path / name / "run" / "report.json") as f:
            reports[name] = json.load(f)
    assert reports["broken"]["steps"] == 4  # resumed at step 6
    assert first_six + reports["broken"]["losses"] == reports["unbroken"]["losses"]


def test_a_trace_that_cannot_be_read_is_named_in_the_report_and_the_run_stands(tmp_path):
    """A trace cut short (a full disk, another process writing the same file) leaves its summary out with the
    reason; the report of a run that trained is still written."""
    from alpa_job.train.profile import StepProfile

    profile = StepProfile(3, 2, str(tmp_path))
    folder = tmp_path / "profile" / "plugins" / "profile" / "2026_11_30_12_00_00"
    folder.mkdir(parents=True)
    (folder / "host.trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": ['))
    profile.done = True
    summary = profile.summary()
    assert summary["trace"] == str(folder / "host.trace.json.gz") and "comm_share" not in summary
    assert summary["summary_error"].startswith(("JSONDecodeError", "ValueError")), summary
