"""A CPU-compiled step's collectives counted as XLA:GPU runs them, on hand-built HLO with known bytes: a
gather XLA:CPU widened from bf16, a gradient all-reduce that every device then slices to its own part, and
one left as it is."""

from __future__ import annotations

from alpa_job.record import gpu_view, traffic

HLO = """HloModule step

%round_through_bf16 (param_0: f32[8,4]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %convert.1 = bf16[8,4]{1,0} convert(%param_0)
  ROOT %convert.2 = f32[8,4]{1,0} convert(%convert.1)
}

%to_bf16 (param_0.1: f32[16,4]) -> bf16[16,4] {
  %param_0.1 = f32[16,4]{1,0} parameter(0)
  ROOT %convert.3 = bf16[16,4]{1,0} convert(%param_0.1)
}

%own_rows (param_0.2: bf16[16,4], param_1.2: u32[]) -> bf16[8,4] {
  %param_0.2 = bf16[16,4]{1,0} parameter(0)
  %param_1.2 = u32[] parameter(1)
  %zero = u32[] constant(0)
  ROOT %dynamic-slice.1 = bf16[8,4]{1,0} dynamic-slice(%param_0.2, %param_1.2, %zero), dynamic_slice_sizes={8,4}
}

ENTRY %main (p: f32[8,4], g: f32[16,4], s: f32[4]) -> (f32[16,4], bf16[8,4], f32[4]) {
  %p = f32[8,4]{1,0} parameter(0)
  %g = f32[16,4]{1,0} parameter(1)
  %s = f32[4]{0} parameter(2)
  %partition-id = u32[] partition-id()
  %rounded = f32[8,4]{1,0} fusion(%p), kind=kLoop, calls=%round_through_bf16
  %all-gather = f32[16,4]{1,0} all-gather(%rounded), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %all-reduce = f32[16,4]{1,0} all-reduce(%g), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %narrow = bf16[16,4]{1,0} fusion(%all-reduce), kind=kLoop, calls=%to_bf16
  %mine = bf16[8,4]{1,0} fusion(%narrow, %partition-id), kind=kLoop, calls=%own_rows
  %all-reduce.1 = f32[4]{0} all-reduce(%s), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  ROOT %tuple = (f32[16,4]{1,0}, bf16[8,4]{1,0}, f32[4]{0}) tuple(%all-gather, %mine, %all-reduce.1)
}
"""


def test_widened_gathers_count_in_bf16_and_a_sliced_all_reduce_is_a_reduce_scatter():
    as_on_gpu = gpu_view.collective_instances(HLO, lambda name: 2)
    assert sorted(as_on_gpu) == [
        ("all-gather", "all-gather", 128),  # 16 x 4 values, bf16 on GPUs (f32 on CPU: 256 bytes)
        ("all-reduce", "all-reduce.1", 16),  # f32 and read whole: as compiled
        ("reduce-scatter", "all-reduce", 64),  # each device keeps 8 x 4 bf16 values of the sum
    ]
    on_gpu = traffic.step_traffic(HLO, 2, 1, as_on_gpu=True)  # one device a node: everything crosses
    on_cpu = traffic.step_traffic(HLO, 2, 1)
    assert sum(r.network_bytes for r in on_cpu) == 128 + 256 + 16  # half the gather, the all-reduces whole
    assert sum(r.network_bytes for r in on_gpu) == 64 + 64 + 16  # half the bf16 gather, half the bf16 sum
