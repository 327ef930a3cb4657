"""The data-parallel experiments in bench/: the bf16-gather step trains the kit's numbers, and the schedule
reader finds collectives, their bytes and the matmuls beside them in a scheduled HLO."""
from __future__ import annotations

import os
import sys

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import data_bf16_gather  # noqa: E402
import gpu_schedule  # noqa: E402
from gpu_common import gpt_case  # noqa: E402

from alpa_job.engines.jax_engine import JaxEngine  # noqa: E402


def _losses(engine_class, config, model, batch, steps=4):
    engine = engine_class(config, model, batch, "data", (jax.device_count(), 1))
    engine.compile()
    state, device_batch = engine.init_state(0), engine.put_batch(batch)
    losses = []
    for _ in range(steps):
        state, loss = engine.step(state, device_batch)
        losses.append(float(loss))
    return engine, state, losses


def test_bf16_gather_trains_the_sharded_updates_numbers_with_a_bf16_copy_of_the_weights():
    rows = jax.device_count()
    config, model, batch = gpt_case("tiny", batch_size=rows, num_samples=rows, compile_cache="none", steps=4)
    _, _, kit = _losses(JaxEngine, config, model, batch)
    engine, state, gathered = _losses(data_bf16_gather.Bf16GatherEngine, config, model, batch)
    assert gathered == kit  # bit for bit: the model casts those weights to bf16 before any use either way

    def dtype_of(tree):
        return {jax.tree_util.keystr(k): v.dtype for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    compute = dtype_of(state.compute)
    full_precision = sorted(k for k, d in compute.items() if d != np.dtype("bfloat16"))
    # Read in fp32 by the model: the embedding lookup (wte, also the tied output's weight), the positions
    # added to it, and the layer norms' scale and bias; every dense weight is read only as bf16.
    assert all(("wte" in k or "wpe" in k or "LayerNorm" in k) for k in full_precision)
    assert any("wte" in k for k in full_precision) and any("kernel" in k for k in compute if k not in full_precision)
    assert set(dtype_of(state.params).values()) == {np.dtype("float32")}  # the master weights stay fp32
    qkv = state.params["DecoderBlock_0"]["CausalSelfAttention_0"]["qkv"]["kernel"]
    assert "data" in qkv.sharding.spec  # split between steps, as fsdp splits it
    assert state.compute["DecoderBlock_0"]["CausalSelfAttention_0"]["qkv"]["kernel"].sharding.is_fully_replicated


_SCHEDULED = """HloModule step, is_scheduled=true

ENTRY %main (p0: f32[8,4], p1: bf16[4,4]) -> f32[16,4] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %ag-start = (f32[8,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%p0), dimensions={0}
  %gemm_fusion = bf16[4,4]{1,0} fusion(%p1), kind=kCustom, calls=%gemm_fusion_dot
  %ag-done = f32[16,4]{1,0} all-gather-done(%ag-start)
  %rs-start = ((bf16[4,4]{1,0}), bf16[2,4]{1,0}) reduce-scatter-start(%gemm_fusion), dimensions={0}
  %cublas = (bf16[4,4]{1,0}, s8[0]{0}) custom-call(%gemm_fusion), custom_call_target="__cublas$gemm"
  %rs-done = bf16[2,4]{1,0} reduce-scatter-done(%rs-start)
  %ag2-start = (f32[8,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%p0), dimensions={0}
  ROOT %ag2-done = f32[16,4]{1,0} all-gather-done(%ag2-start)
}
"""


def test_the_schedule_reader_counts_bytes_the_matmuls_beside_each_collective_and_the_tail():
    report = gpu_schedule.overlap_report(_SCHEDULED)
    assert report["matmuls"] == 2
    gather, scatter = report["all-gather"], report["reduce-scatter"]
    assert gather["count"] == 2 and gather["bytes"] == 2 * 16 * 4 * 4
    assert gather["with_no_matmul_beside"] == 1  # the first hides behind a matmul; the second runs alone
    assert gather["bytes_after_last_matmul"] == 16 * 4 * 4 and gather["dtypes"] == ["f32"]
    assert scatter["count"] == 1 and scatter["matmuls_beside_each_median"] == 1 and scatter["dtypes"] == ["bf16"]
    assert scatter["bytes_after_last_matmul"] == 2 * 4 * 2  # started beside the last matmul, done after it
    assert gpu_schedule.shape_bytes("(bf16[2,4]{1,0}, f32[3]{0})") == 2 * 8 + 4 * 3


def test_bf16_gather_at_the_steps_start_trains_the_same_numbers_from_split_weights_alone():
    rows = jax.device_count()
    config, model, batch = gpt_case("tiny", batch_size=rows, num_samples=rows, compile_cache="none", steps=4)
    _, _, kit = _losses(JaxEngine, config, model, batch)
    engine, state, gathered = _losses(data_bf16_gather.Bf16GatherAtStartEngine, config, model, batch)
    assert gathered == kit
    assert not hasattr(state, "compute")  # nothing but the kit's own state fields
    qkv = state.params["DecoderBlock_0"]["CausalSelfAttention_0"]["qkv"]["kernel"]
    assert "data" in qkv.sharding.spec and qkv.dtype == np.dtype("float32")
