"""bench/gpu_schedule.py's reader finds collectives, their bytes and the matmuls beside them in a scheduled HLO."""

from __future__ import annotations

import gpu_schedule  # bench/, on pytest's pythonpath

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
