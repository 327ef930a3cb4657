"""The step's model FLOPs counted on its jaxpr (engines/flops.py) agree with the textbook GPT formula,
count convolutions, and follow loops (issue 16, item 4: MFU in the report); causal attention counts at half
in the MFU's count, as MaxText counts it, the full count beside it (issue 40, item 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from alpa_job.data import epoch_batches, synthetic
from alpa_job.engines.flops import step_flops
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.models import get_model
from helpers_train import job_config


def _engine(model: str, **fields):
    config = job_config(model=model, steps=1, address="none", compile_cache="none", **fields).validated()
    batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
    engine = JaxEngine(config, get_model(config), batch, "data", (8, 1))
    engine.compile()
    return config, engine


@pytest.fixture(scope="module")
def gpt():
    """A 3-layer GPT's compiled step (the einsum attention: CPU), shared by the tests that read its count."""
    return _engine("gpt", num_layers=3, d_model=128, num_heads=4, seq_len=64, vocab_size=512, num_samples=16, batch_size=16)


def test_gpt_step_flops_match_6_params_tokens_plus_attention(gpt):
    config, engine = gpt
    params = sum(x.size for x in jax.tree_util.tree_leaves(engine.abstract_state.params))
    sizes = config.model_args  # typed, every GPT setting (job_config resolves them)
    tokens = config.batch_size * sizes["seq_len"]
    formula = 6 * params * tokens + 12 * sizes["num_layers"] * config.batch_size * sizes["seq_len"] ** 2 * sizes["d_model"]
    counted = engine.stats.flops_per_step
    # The formula also counts the parameters no matmul uses (positions, LayerNorms, biases): < 2% here.
    assert counted == pytest.approx(formula, rel=0.02), (counted, formula)
    assert counted < formula


def test_gpt_causal_attention_counts_as_maxtext_counts_it(gpt):
    """The GPT declares its attention causal: its attention products (forward q.k^T and P.v, the backward's
    four) are found exactly, 12 * L * B * S^2 * D whole, and MaxText's count takes half of them."""
    from alpa_job.engines.flops import maxtext_flops

    config, engine = gpt
    sizes, batch = config.model_args, config.batch_size
    attention = 12 * sizes["num_layers"] * batch * sizes["seq_len"] ** 2 * sizes["d_model"]
    assert engine.stats.causal_attention_flops_per_step == attention
    maxtext = maxtext_flops(engine.stats.flops_per_step, engine.stats.causal_attention_flops_per_step)
    assert engine.stats.flops_per_step - maxtext == attention / 2
    params = sum(x.size for x in jax.tree_util.tree_leaves(engine.abstract_state.params))
    formula = 6 * params * batch * sizes["seq_len"] + 6 * sizes["num_layers"] * batch * sizes["seq_len"] ** 2 * sizes["d_model"]
    assert maxtext == pytest.approx(formula, rel=0.02) and maxtext < formula  # parameters no matmul uses


def _llama_step(causal_attention: bool):
    """The LLaMA example's gradient (grouped-query attention, einsum form; head size = sequence length, so a
    query or key is as square as the scores) traced, counted with or without its declaration."""
    import os
    import sys

    from alpa_job.engines.flops import step_count

    llama_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "llama")
    if llama_dir not in sys.path:
        sys.path.insert(0, llama_dir)
    from llama_example.model import LlamaArgs, build

    args = LlamaArgs(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, seq_len=16, vocab_size=64, attention="einsum")
    model = build(args, jnp.float32)
    tokens = jnp.zeros((3, args.seq_len + 1), jnp.int32)
    params = jax.eval_shape(model.module.init, jax.random.PRNGKey(0), tokens)["params"]

    def loss(p):
        return model.loss(model.module.apply({"params": p}, tokens), {"tokens": tokens}).mean()

    declared = model.causal_attention and causal_attention
    return args, step_count(jax.jit(jax.grad(loss)).trace(params), declared)


def test_llama_example_declares_causal_attention_and_its_grouped_products_are_found():
    args, count = _llama_step(causal_attention=True)
    assert count.causal_attention == 12 * args.num_layers * 3 * args.seq_len**2 * args.d_model
    undeclared = _llama_step(causal_attention=False)[1]
    assert undeclared.total == count.total and undeclared.causal_attention == 0


def test_a_model_declaring_nothing_gets_the_full_count_and_the_report_says_so():
    """No declaration: no dot_general counts as causal attention (MFU on the full count, `mfu_count`
    "full"); dense layers' products are never attention, declared or not."""
    from alpa_job.engines.flops import step_count
    from alpa_job.inspect.render import speed_text
    from alpa_job.train import timing

    w = jnp.ones((64, 64))
    dense = step_count(jax.jit(lambda x: jnp.tanh(x @ w) @ w).trace(jnp.ones((64, 64))), causal_attention=True)
    assert dense.causal_attention == 0 and dense.total == 2 * 2 * 64**3
    out = timing.summary({}, [1.0], 394e12, "NVIDIA H200", "bfloat16", 1, None, None, causal_attention_flops=0.0)
    assert out["mfu_count"] == "full" and out["mfu"] == out["mfu_full"] == 0.5
    assert speed_text(out).endswith("FLOPs counted whole (no causal attention counted: api.Model.causal_attention)")


def test_cudnn_fused_attention_says_itself_whether_it_is_causal():
    """cuDNN's custom call (not traceable on a CPU: a stand-in equation) carries its mask: causal halves in
    MaxText's count whatever the model declares; no mask, or a sliding window, stays whole."""
    from types import SimpleNamespace

    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    from alpa_job.engines.flops import jaxpr_count

    def call(name, mask, window=None):
        q = SimpleNamespace(aval=SimpleNamespace(shape=(2, 128, 4, 64)))  # [batch, seq, heads, head_dim]
        return SimpleNamespace(
            primitive=SimpleNamespace(name=name), invars=[q, q, q], params={"mask_type": mask, "sliding_window_length": window}
        )

    forward = 4.0 * 2 * 4 * 128 * 128 * 64
    causal = jaxpr_count(
        SimpleNamespace(eqns=[call("dot_product_attention_fwd", MaskType.CAUSAL), call("dot_product_attention_bwd", MaskType.CAUSAL)])
    )
    assert causal.total == causal.causal_attention == 3 * forward
    assert causal.maxtext == 1.5 * forward
    for mask, window in ((MaskType.NO_MASK, None), (MaskType.CAUSAL, 32)):
        assert jaxpr_count(SimpleNamespace(eqns=[call("dot_product_attention_fwd", mask, window)])).causal_attention == 0


def test_convolutions_are_counted_and_scale_with_the_batch():
    _, small = _engine("wide_resnet", num_samples=8, batch_size=8)
    _, large = _engine("wide_resnet", num_samples=16, batch_size=16)
    assert small.stats.flops_per_step > 1e9  # a WRN-10-2 step on 32x32 images: GFLOPs, not the dense head's
    assert large.stats.flops_per_step == pytest.approx(2 * small.stats.flops_per_step, rel=1e-6)


def test_a_scan_counts_its_body_per_iteration_and_a_cond_its_costliest_branch():
    w = jnp.ones((64, 64))

    def one(x):
        return x @ w

    def scanned(x):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]

    def branched(x, p):
        return jax.lax.cond(p, lambda v: (v @ w) @ w, lambda v: v, x)

    x = jnp.ones((8, 64))
    single = step_flops(jax.jit(one).trace(x))
    assert single == 2 * 8 * 64 * 64
    assert step_flops(jax.jit(scanned).trace(x)) == 5 * single
    assert step_flops(jax.jit(branched).trace(x, True)) == 2 * single


def test_a_shard_map_counts_its_body_once_per_device_of_its_manual_axes():
    """The pipeline's step is a shard_map: its body is one device's work, so the step's count (all devices
    together) multiplies it by the devices that run it; an axis left automatic does not multiply."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from alpa_job.jax_compat import shard_map

    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    w = jnp.ones((64, 64))
    x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P(("stage", "data"))))
    whole = step_flops(jax.jit(lambda v: v @ w).trace(x))
    split = shard_map()(lambda v: v @ w, mesh=mesh, in_specs=P(("stage", "data")), out_specs=P(("stage", "data")))
    assert step_flops(jax.jit(split).trace(x)) == whole  # 8 devices, an eighth of the rows each
    assert whole == 2 * 32 * 64 * 64


def test_report_has_flops_and_tflops_on_cpu(tmp_path):
    from alpa_job.train.loop import train_process

    config = job_config(
        model="gpt",
        num_layers=2,
        d_model=64,
        num_heads=4,
        seq_len=32,
        vocab_size=128,
        num_samples=32,
        batch_size=8,
        steps=4,
        address="none",
        compile_cache="none",
        out=str(tmp_path),
    ).validated()
    timing = train_process(config).timing
    assert timing["flops_per_step"] and timing["flops_per_step"] > 0
    assert timing["tflops_per_device"] is not None
    assert timing["mfu"] is None  # no known peak for a CPU
    # The GPT declares its attention causal: the report's MFU count takes half of it, the full count kept.
    assert timing["mfu_count"] == "maxtext" and 0 < timing["causal_attention_flops_per_step"] < timing["flops_per_step"]
    assert timing["mfu_flops_per_step"] == timing["flops_per_step"] - timing["causal_attention_flops_per_step"] / 2
    assert "tflops_per_device_full" in timing and timing["mfu_full"] is None


def test_mfu_on_both_bases_in_each_precision_and_the_report_names_the_peaks():
    """A step's rate against the measured matmul peak and the datasheet's, for the precision the run's
    matmuls take (bf16; float32 on Hopper's TF32 tensor cores); none where the device or precision is unknown."""
    from alpa_job.inspect.render import speed_text
    from alpa_job.train import timing

    def summary(kind, dtype, flops=394e12 * 2):  # a step of 2 devices at 394 TFLOP/s each, 1 s
        return timing.summary({}, [1.0, 1.0], flops, kind, dtype, 2, None, None, samples_per_step=8, tokens_per_sample=1024)

    bf16 = summary("NVIDIA H200", "bfloat16")
    assert bf16["peak"] == {"precision": "bf16", "measured_tflops": 788.0, "datasheet_tflops": 989.4}
    assert bf16["mfu"] == 0.5 and bf16["mfu_datasheet"] == round(394 / 989.4, 3)
    assert bf16["tokens_per_s_per_device"] == 4096.0  # 8 samples x 1024 tokens a second, over 2 devices
    fp32 = summary("NVIDIA H200", "float32", flops=170.5e12 * 2)
    assert fp32["peak"]["precision"] == "tf32" and fp32["mfu"] == 0.5 and fp32["mfu_datasheet"] == 0.345
    h100_fp32 = summary("NVIDIA H100 80GB HBM3", "float32")
    assert h100_fp32["mfu"] is None and h100_fp32["mfu_datasheet"] is not None  # no measured TF32 peak there
    cpu = summary("cpu", "float32")
    assert cpu["peak"] == {"precision": "fp32", "measured_tflops": None, "datasheet_tflops": None}
    assert cpu["mfu"] is None and cpu["mfu_datasheet"] is None
    from alpa_job.progress.display import format_step

    line = format_step({"desc": "train", "step": 3, "total_step": 9, "rate": 8.0, "tokens_per_s_device": 4096})
    assert line == "[train] step 3/9  8 samples/s  4,096 tokens/s a device", line
    text = speed_text(bf16)
    assert text == (
        "steady step 1000 ms; 4,096 tokens/s a device; 394.0 TFLOP/s a device; MFU 0.50 of 788.0 "
        "TFLOP/s (bf16, measured); MFU 0.40 of 989.4 TFLOP/s (bf16, datasheet); FLOPs counted whole "
        "(no causal attention counted: api.Model.causal_attention)"
    ), text


def test_mfu_counts_causal_attention_at_half_and_keeps_the_full_count_beside_it():
    """A causal decoder's step: `mfu`, `mfu_datasheet` and `tflops_per_device` on MaxText's count, the same
    three `_full` on every product whole; the report's text names both counts."""
    from alpa_job.inspect.render import speed_text
    from alpa_job.train import timing

    # 2 devices, 1 s a step: 2 x 394 TFLOP counted whole, of which 2 x 78.8 causal attention.
    out = timing.summary({}, [1.0, 1.0], 394e12 * 2, "NVIDIA H200", "bfloat16", 2, None, None, causal_attention_flops=78.8e12 * 2)
    assert out["mfu_count"] == "maxtext" and out["mfu_flops_per_step"] == (394e12 - 39.4e12) * 2
    assert (out["tflops_per_device"], out["mfu"], out["mfu_datasheet"]) == (354.6, 0.45, round(354.6 / 989.4, 3))
    assert (out["tflops_per_device_full"], out["mfu_full"], out["mfu_datasheet_full"]) == (394.0, 0.5, 0.398)
    assert out["flops_per_step"] == 394e12 * 2 and out["causal_attention_flops_per_step"] == 78.8e12 * 2
    assert speed_text(out) == (
        "steady step 1000 ms; 354.6 TFLOP/s a device; MFU 0.45 of 788.0 TFLOP/s (bf16, measured); MFU 0.36 of "
        "989.4 TFLOP/s (bf16, datasheet); FLOPs counted as MaxText does, causal attention at half; counted "
        "whole: 394.0 TFLOP/s a device, MFU 0.50 of 788.0 TFLOP/s (bf16, measured), MFU 0.40 of 989.4 TFLOP/s "
        "(bf16, datasheet)"
    )
