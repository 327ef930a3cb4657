"""Collective counting over both HLO text styles (Alpa 0.2.3 era and modern jax)."""

from alpa_job.record.hlo import COLLECTIVE_KINDS, count_collectives, merge_counts, shape_bytes

OLD_STYLE = """\
HloModule train_step_shard_parallel, input_output_alias={ {0}: (0, {}, may-alias) }

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main_spmd (param: f32[8,8]) -> f32[8,8] {
  %param = f32[8,8]{1,0} parameter(0)
  %all-reduce.1 = f32[8,8]{1,0} all-reduce(f32[8,8]{1,0} %param), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="all-gather"}
  %all-reduce.2 = (f32[4]{0}, bf16[2,2]{1,0}) all-reduce(f32[4]{0} %a, bf16[2,2]{1,0} %b), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %all-gather.3 = f32[16,8]{1,0} all-gather(f32[8,8]{1,0} %param), channel_id=3, replica_groups={{0,1}}, dimensions={0}
  %reduce-scatter.4 = f32[4,8]{1,0} reduce-scatter(f32[8,8]{1,0} %param), channel_id=4, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
  %all-to-all.5 = s32[8,8]{1,0} all-to-all(s32[8,8]{1,0} %i), channel_id=5, replica_groups={{0,1}}, dimensions={0}
  %collective-permute.6 = f32[8,8]{1,0} collective-permute(f32[8,8]{1,0} %param), channel_id=6, source_target_pairs={{0,1},{1,0}}
  ROOT %copy = f32[8,8]{1,0} copy(f32[8,8]{1,0} %all-reduce.1)
}
"""

NEW_STYLE = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

region_0.1 {
  Arg_0.2 = f32[] parameter(0)
  Arg_1.3 = f32[] parameter(1)
  ROOT add.4 = f32[] add(Arg_0.2, Arg_1.3)
}

async_computation {
  param_0 = f32[8,8]{1,0} parameter(0)
  ROOT reduce-scatter.9 = f32[4,8]{1,0} reduce-scatter(param_0), channel_id=9, replica_groups=[1,2]<=[2], dimensions={0}, to_apply=region_0.1
}

ENTRY main.10 {
  p = f32[8,8]{1,0} parameter(0)
  all-reduce-start = f32[8,8]{1,0} all-reduce-start(p), channel_id=1, replica_groups=[1,2]<=[2], use_global_device_ids=true, to_apply=region_0.1
  all-reduce-done = f32[8,8]{1,0} all-reduce-done(all-reduce-start)
  all-reduce-start.1 = (f32[2]{0}, f32[3]{0}) all-reduce-start(a, b), channel_id=2, replica_groups={{0,1}}, to_apply=region_0.1
  all-reduce-done.1 = (f32[2]{0}, f32[3]{0}) all-reduce-done(all-reduce-start.1)
  all-gather-start = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(x), channel_id=3, replica_groups=[1,2]<=[2], dimensions={0}, use_global_device_ids=true
  all-gather-done = f32[8,8]{1,0} all-gather-done(all-gather-start)
  collective-permute-start = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(p), channel_id=4, source_target_pairs={{0,1},{1,0}}
  collective-permute-done = f32[8,8]{1,0} collective-permute-done(collective-permute-start)
  reduce-scatter-start = ((f32[8,8]{1,0}), f32[4,8]{1,0}) async-start(p), calls=async_computation
  reduce-scatter-done = f32[4,8]{1,0} async-done(reduce-scatter-start), calls=async_computation
  all-to-all = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-to-all(u, v), channel_id=5, replica_groups={{0,1}}
  ROOT r = f32[8,8]{1,0} add(all-reduce-done, all-gather-done)
}
"""


def test_old_style_counts_and_bytes():
    c = count_collectives(OLD_STYLE)
    assert set(c) == set(COLLECTIVE_KINDS)
    assert c["all-reduce"] == {"count": 2, "bytes": 256 + 16 + 8}  # tuple result summed
    assert c["all-gather"] == {"count": 1, "bytes": 512}
    assert c["reduce-scatter"] == {"count": 1, "bytes": 128}
    assert c["all-to-all"] == {"count": 1, "bytes": 256}
    assert c["collective-permute"] == {"count": 1, "bytes": 256}


def test_new_style_async_pairs_count_once_with_done_bytes():
    c = count_collectives(NEW_STYLE)
    assert c["all-reduce"] == {"count": 2, "bytes": 256 + 20}
    assert c["all-gather"] == {"count": 1, "bytes": 256}  # the -done output, not the tuple
    assert c["collective-permute"] == {"count": 1, "bytes": 256}
    assert c["reduce-scatter"] == {"count": 1, "bytes": 128}  # inside the async computation
    assert c["all-to-all"] == {"count": 1, "bytes": 256}


def test_start_without_done_uses_output_part():
    text = (
        "  ag = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(x), dimensions={0}\n"
        "  cp = (f32[2]{0}, f32[2]{0}, u32[], u32[]) collective-permute-start(y)\n"
    )
    c = count_collectives(text)
    assert c["all-gather"] == {"count": 1, "bytes": 256}
    assert c["collective-permute"] == {"count": 1, "bytes": 8}


def test_no_collectives_and_non_instructions():
    c = count_collectives(
        'HloModule m\n\nENTRY %e (p: f32[2]) -> f32[2] {\n  ROOT %p = f32[2]{0} parameter(0), metadata={op_name="all-reduce"}\n}\n'
    )
    assert all(v == {"count": 0, "bytes": 0} for v in c.values())
    assert count_collectives("") == {k: {"count": 0, "bytes": 0} for k in COLLECTIVE_KINDS}


def test_shape_bytes_and_merge():
    assert shape_bytes("f32[8,8]{1,0}") == 256
    assert shape_bytes("bf16[3]") == 6
    assert shape_bytes("pred[]") == 1
    assert shape_bytes("s4[3]") == 2  # sub-byte rounded up
    assert shape_bytes("f32[<=8]") == 32
    assert shape_bytes("(f32[2], token[])") == 8
    m = merge_counts(count_collectives(OLD_STYLE), count_collectives(NEW_STYLE))
    assert m["all-reduce"]["count"] == 4 and m["all-gather"]["bytes"] == 768


def test_old_style_typed_async_done_operand():
    text = (
        "  %ag-start = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(f32[4,8]{1,0} %x), dimensions={0}\n"
        "  %ag-done = f32[8,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[8,8]{1,0}) %ag-start)\n"
    )
    assert count_collectives(text)["all-gather"] == {"count": 1, "bytes": 256}
