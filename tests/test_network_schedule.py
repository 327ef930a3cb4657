"""--network-gbps: XLA's scheduler told what each collective across hosts costs (engines/network_schedule.py).

On CPU devices: which collectives of a pipelined step cross hosts, and what they are costed at. Compiled for
two H100s without a GPU (XLA:GPU's own scheduler): the engine compiles the step again with those costs, and
the shell's gradient sum between the stages starts beside many more matmuls than in XLA's own schedule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from alpa_job.data import epoch_batches, synthetic
from alpa_job.engines import network_schedule
from alpa_job.planner import gpu_target
from alpa_job.record import hlo
from helpers_train import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_collectives_between_hosts_are_costed_at_the_stated_rate(tmp_path):
    """2 stages x 4 data on 8 CPU devices (a block a stage), each stage a host: the stages' hand-offs and the shell's sum cross
    hosts and are costed at their bytes over 10 Gbit/s; a sum over one stage's devices stays in its host."""
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model

    config = tiny_config("gpt", num_layers=2, batch_size=16, num_samples=16, micro_batches=2, compile_cache="none")
    batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
    engine = JaxEngine(config, get_model(config), batch, "pipeline", (2, 4))
    text = engine.compile().hlo_texts[0]
    hosts = [0, 0, 0, 0, 1, 1, 1, 1]  # mesh order: stage 0's devices, then stage 1's
    costs = network_schedule.collective_costs(text, hosts, 10.0)
    kinds = {name: kind for kind, name, _ in hlo.collective_instances(text)}
    assert {kinds[name] for name in costs} >= {"collective-permute", "all-reduce"}, costs
    assert set(kinds) - set(costs), "every collective costed: none stayed inside a host"
    permute = next(name for name in costs if kinds[name] == "collective-permute")
    hand_off = next(size for kind, name, size in hlo.collective_instances(text) if name == permute)
    assert costs[permute] == pytest.approx(network_schedule.LAUNCH_US + hand_off / (10e9 / 8) * 1e6, abs=0.1)
    path = network_schedule.written_profile(costs, str(tmp_path))
    assert path == network_schedule.written_profile(dict(costs), str(tmp_path))  # named by its content
    lines = open(path).read().splitlines()
    assert len(lines) == len(costs) and f'costs {{ name: "{permute}" cost_us: {costs[permute]} }}' in lines


_DEVICELESS = r"""
import json
from alpa_job.planner import gpu_target
gpu_target.prepare()
from alpa_job.engines import jax_engine, memory_fit, network_schedule
from alpa_job.data import epoch_batches, synthetic
from alpa_job.models import get_model
from helpers_train import tiny_config

gpu_target.present_as_gpu()
targets = gpu_target.devices("h100", 2)
jax_engine.make_mesh = lambda shape, axes: gpu_target.mesh(targets, shape, axes)
memory_fit.check_state_fits = lambda *a, **k: None  # it reads the local devices' memory: there are none
sizes = dict(num_layers=2, d_model=256, num_heads=8, seq_len=128, vocab_size=4096)
config = tiny_config("gpt", dtype="bfloat16", batch_size=16, num_samples=16, micro_batches=4, compile_cache="none",
                     network_gbps=1.0, **sizes)
batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
engine = jax_engine.JaxEngine(config, get_model(config), batch, "pipeline", (2, 1))
engine._device_hosts = lambda: [0, 1]  # the two GPUs on two hosts, as a job of two processes has them
first = []
costed = network_schedule.collective_costs
network_schedule.collective_costs = lambda text, *args: first.append(text) or costed(text, *args)
stats = engine.compile()
print(json.dumps({"first": first[0], "final": stats.hlo_texts[0], "options": engine.compiler_options,
                  "notes": engine.notes(), "compiles": stats.compiles}))
"""


def _matmuls_beside_largest_all_reduce(text: str) -> int:
    """Matmuls scheduled between the start and the done of the step's largest all-reduce (the shell's sum)."""
    from gpu_schedule import entry_schedule, is_matmul  # the bench's reading of a GPU schedule

    ops = entry_schedule(text)
    starts, largest = {}, (0, 0)
    for i, (name, shape, opcode, rest) in enumerate(ops):
        if opcode == "all-reduce-start":
            starts[name] = i
        elif opcode == "all-reduce-done":
            begun = starts[hlo.start_operand(rest, starts)]
            largest = max(largest, (hlo.shape_bytes(shape), sum(1 for _, _, op, r in ops[begun:i] if is_matmul(op, r))))
    return largest[1]


@pytest.mark.skipif(gpu_target.plugin() is None, reason="JAX's CUDA plugin is not installed (.ci/run installs it)")
def test_the_gpu_step_is_compiled_again_with_the_networks_costs_and_hides_the_shells_sum():
    """A GPT of 2 blocks in 2 stages on 2 x H100, each GPU a host of its own, --network-gbps 1: the engine
    compiles the step, costs its collectives across hosts, and compiles it again with the profile; in the
    final schedule the shell's gradient sum runs beside several times the matmuls of XLA's own. XLA's warning
    for each instruction the profile leaves out (all but the collectives) is not passed on."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    proc = subprocess.run([sys.executable, "-c", _DEVICELESS], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile_guided_latency" not in proc.stderr  # XLA's line for each instruction the profile leaves out
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["compiles"] == 2 and network_schedule.PROFILE_OPTION in out["options"], out["options"]
    assert any(note.startswith("--network-gbps 1: XLA scheduled the step knowing its") for note in out["notes"]), out["notes"]
    before, after = (_matmuls_beside_largest_all_reduce(out[key]) for key in ("first", "final"))
    assert after >= 3 * max(before, 1), (before, after)
