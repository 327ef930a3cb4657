"""`python -m alpa_job plan`: the planner against real emulated runs, its calibration, its CLI and its bad input.

All on CPU: real JAX on 8 emulated devices (subprocesses), the real plan command, the shipped calibration file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from alpa_job import cli
from alpa_job.planner import estimate, gpus, placement
from alpa_job.planner import plan as plan_lib
from alpa_job.record import traffic
from alpa_job.planner.calibrate import cpu_features, request_for
from alpa_job.planner.run_worker import compile_in_worker
from alpa_job.record.plan_record import load_plan_schema

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_GPT = {
    "model": "gpt",
    "num_layers": 2,
    "d_model": 64,
    "num_heads": 4,
    "seq_len": 32,
    "vocab_size": 256,
    "batch_size": 16,
    "num_samples": 16,
    "dataset": "synthetic",
    "compile_cache": "none",
}


def test_state_bytes_collectives_and_flops_equal_a_real_engine_on_8_devices():
    """Per strategy: the planner's state bytes = what device 0 really holds after init_state; its collective
    counts = the real engine's compiled HLO's; its FLOPs = the engine's."""
    request = {
        "preset": None,
        "config": None,
        "devices": 8,
        "gpus_per_node": 4,
        "cli_values": TINY_GPT,
        "candidates": [["data", [8, 1]], ["fsdp", [8, 1]], ["tensor", [4, 2]], ["tensor", [2, 4]]],
    }
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "planner_engine_check.py"), json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(result) == 4
    for name, row in result.items():
        assert row["planned_state_bytes"] == row["real_state_bytes_device0"], name
        assert row["planned_collectives"] == row["real_collectives"], name
        assert row["planned_flops"] == row["real_flops"], name
    # data's sharded update keeps the parameters and Adam's moments split between steps, as fsdp does.
    assert result["fsdp(8, 1)"]["planned_state_bytes"] == result["data(8, 1)"]["planned_state_bytes"]
    assert result["data(8, 1)"]["real_collectives"]["all-gather"] > 0


def test_replica_group_formats_and_traffic_split():
    assert traffic.replica_groups("replica_groups={{0,2},{1,3}}, x", 4) == [[0, 2], [1, 3]]
    assert traffic.replica_groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert traffic.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, x"
    assert traffic.replica_groups(mesh, 8) == [[0, 1], [4, 5], [2, 3], [6, 7]] or sorted(map(sorted, traffic.replica_groups(mesh, 8))) == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert traffic.replica_groups("replica_groups=mesh['a'=2,'b'=4] {'b'}, x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # 8 devices, 4 a node: a group inside a node uses NVLink only; one device a node uses the network only.
    inside = traffic.traffic("all-reduce", 1000, [[0, 1, 2, 3], [4, 5, 6, 7]], 8, 4)
    assert (inside.nvlink_bytes, inside.network_bytes) == (1500.0, 0.0)
    across = traffic.traffic("all-reduce", 1000, [[0, 4], [1, 5], [2, 6], [3, 7]], 8, 4)
    assert (across.nvlink_bytes, across.network_bytes) == (0.0, 1000.0)
    both = traffic.traffic("all-gather", 800, [list(range(8))], 8, 4)
    assert (both.nvlink_bytes, both.network_bytes) == (600.0, 100.0)
    assert placement.node_axes((2, 4), 4) == {"model": "inside a node", "data": "across nodes"}


def test_calibration_predicts_every_measured_run_within_20_percent_and_a_winner_within_5_percent():
    """Reads calibration.json: holds for whatever measured runs it holds."""
    data = estimate.load()
    constants = estimate.fit(data)
    groups = {}
    for entry in data["entries"]:
        devices = entry["nodes"] * entry["gpus_per_node"]
        row = {**entry["cpu"], "strategy": entry["strategy"]}
        predicted = estimate.predict(row, devices, gpus.CATALOGUE[entry["gpu"]], 50e9, constants)["step_s"] * 1e3
        error = abs(predicted - entry["measured_step_ms"]) / entry["measured_step_ms"]
        assert error <= 0.20, (entry["id"], predicted, entry["measured_step_ms"])
        key = (entry["gpu"], entry["preset"], entry["batch_size"], devices)
        groups.setdefault(key, []).append((entry, predicted))
    for key, rows in groups.items():
        if len(rows) < 2:
            continue
        # The winner as a user judges it: the planned strategy measured within 5 % of the fastest
        # (two strategies a few ms apart swap places between calls).
        best_ms = min(entry["measured_step_ms"] for entry, _ in rows)
        planned = min(rows, key=lambda r: r[1])[0]
        assert planned["measured_step_ms"] <= 1.05 * best_ms, (key, planned["id"])
        for entry, _ in rows:
            chose = entry.get("auto_chose")
            assert chose is None or min(e["measured_step_ms"] for e, _ in rows if e["strategy"] == chose) <= 1.05 * best_ms, entry["id"]
    known = [e for e in data["entries"] if e.get("measured_peak_gb")]
    for entry in known:
        peak = estimate.gpu_peak_bytes(entry["cpu"]["memory"], constants) / 1e9
        assert abs(peak - entry["measured_peak_gb"]) / entry["measured_peak_gb"] <= 0.10, entry["id"]


def test_the_expected_error_comes_from_runs_across_hosts_the_fit_never_saw():
    """validation.json's measured runs (2 hosts x 1 and 2 H200s, NCCL over sockets) predicted with the constants
    fitted to calibration.json: none of them among the fitted, the worst within 30 %, and the plan states the
    median and worst it finds."""
    constants = estimate.fit(estimate.load())
    checked = estimate.validation(constants)
    ids = {run["id"] for run in checked["runs"]}
    assert len(ids) >= 7 and not ids & set(constants.fitted_from)
    assert checked["worst"] <= 0.30, checked["runs"]
    line = plan_lib._expected_error(constants)
    assert f"{checked['median']:.0%} median, {checked['worst']:.0%} worst, over {len(ids)} measured" in line


def test_nvlink_time_is_scaled_by_the_factor_and_network_time_exposed_in_full():
    """NVLink: the fitted factor (what one-node runs hid), but never less than what compute cannot hide. The
    network: its measured bandwidth, none of it hidden, whatever the factor."""
    constants = estimate.Constants(efficiency=0.5, comm_factor={"fsdp": 0.05}, default_comm_factor=0.5, temp_ratio=1.0, fitted_from=[])
    gpu = gpus.CATALOGUE["h100"]
    compute_s = 1e15 / (gpu.peak_flops * 0.5)

    def communication(nvlink_bytes, network_bytes, network_bytes_s=1e9):
        collectives = {"all-gather": {"nvlink_bytes": nvlink_bytes, "network_bytes": network_bytes}}
        row = {"flops_per_step": 1e15, "collectives": collectives, "strategy": "fsdp", "memory": None}
        return estimate.predict(row, 1, gpu, network_bytes_s, constants)["communication_s"]

    long_nvlink = 2 * compute_s * gpu.nvlink_bytes_s  # NVLink bytes of twice the compute: half exposed
    assert communication(long_nvlink, 0.0) == pytest.approx(compute_s)
    short_nvlink = 0.5 * compute_s * gpu.nvlink_bytes_s  # hidden but the factor
    assert communication(short_nvlink, 0.0) == pytest.approx(0.05 * 0.5 * compute_s)
    assert communication(0.0, 2 * compute_s * 1e9) == pytest.approx(2 * compute_s)  # 2x compute at 1 GB/s
    assert communication(short_nvlink, 1e6, 1e12) == pytest.approx(0.05 * 0.5 * compute_s + 1e-6)


def test_calibration_cpu_block_is_current():
    """The cheapest entry recompiled now gives the FLOPs, collectives and memory stored for it (else:
    python -m alpa_job.planner.calibrate)."""
    data = estimate.load()
    entry = min(data["entries"], key=lambda e: (e["nodes"] * e["gpus_per_node"], e["preset"] != "gpt-12l"))
    row = compile_in_worker(request_for(entry), 600)["candidates"][0]
    fresh, stored = cpu_features(row), entry["cpu"]
    assert fresh["flops_per_step"] == stored["flops_per_step"]
    assert fresh["state_bytes_per_device"] == stored["state_bytes_per_device"]
    assert {k: v["count"] for k, v in fresh["collectives"].items()} == {k: v["count"] for k, v in stored["collectives"].items()}
    assert (
        abs(fresh["memory"]["temp_size_in_bytes"] - stored["memory"]["temp_size_in_bytes"]) <= 0.02 * stored["memory"]["temp_size_in_bytes"]
    )


def _doctor_result_over_loopback(path):
    """A doctor --network result of one link measured for real (loopback, both ways), as the doctor writes it."""
    from alpa_job.cluster.doctor import links, network

    rows = []
    for src, dst in (("127.0.0.2", "127.0.0.3"), ("127.0.0.3", "127.0.0.2")):
        receiver = links.LinkReceiver(dst, (40000, 49999), hold_s=30)
        try:
            sent = links.send_stream(src, dst, receiver.port, 0.2, 2.0)
            rows.append(network.link_row(src, dst, sent, receiver.take(src), None))
        finally:
            receiver.close()
    result = {"ok": True, "network": {"links": rows, "declared_gbps": 0, **network.summary(rows)}}
    path.write_text(json.dumps(result))
    return result["network"]["median_gbps"]


def test_plan_2_nodes_x_4_end_to_end(tmp_path):
    out = tmp_path / "plan"
    median = _doctor_result_over_loopback(tmp_path / "doctor.json")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "alpa_job",
            "plan",
            "--preset",
            "gpt-small",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--num-layers",
            "2",
            "--out",
            str(out),
            "--network-from",
            str(tmp_path / "doctor.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    # the measured link, shared by a node's 4 GPUs, is the plan's network figure, and it says so
    assert plan["cluster"]["network_bytes_s"] == pytest.approx(median / 4 * 1e9 / 8, rel=1e-6)
    assert any(a.startswith("network ") and "doctor.json) shared by 4 GPU(s) a node" in a for a in plan["assumptions"])
    assert "candidate 7/7" in proc.stderr  # progress per candidate
    # auto costs FLOPs here: the pipelined candidates across the 2 nodes are slow to compile for the GPU
    assert plan["constants"]["cost_model"] == "flops" and plan["assumptions"][0].startswith("cost model: FLOPs (auto:")
    plan = json.loads((out / "plan.json").read_text())
    jsonschema.validate(plan, load_plan_schema())
    rows = plan["candidates"]
    assert [(r["strategy"], tuple(r["mesh_shape"])) for r in rows] == [
        ("data", (8, 1)),
        ("fsdp", (8, 1)),
        ("tensor", (4, 2)),
        ("tensor", (2, 4)),  # model axis inside a node
        ("hsdp", (2, 4)),  # two-level: nodes x their GPUs
        ("pipeline", (2, 4)),
        ("pipeline-fsdp", (2, 4)),
    ]  # a stage a node, data / fsdp over its GPUs; in this order though the workers compiled them side by side
    ranked = sorted((r for r in rows if r["rank"]), key=lambda r: r["rank"])
    assert [r["step_s"] for r in ranked] == sorted(r["step_s"] for r in ranked)
    assert plan["best"] is not None and plan["candidates"][plan["best"]]["rank"] == 1
    by = {(r["strategy"], tuple(r["mesh_shape"])): r for r in rows}
    # data: the gradient all-reduce crosses nodes; tensor 2x4 keeps model in a node.
    assert by[("data", (8, 1))]["network_bytes"] > 0
    assert by[("tensor", (2, 4))]["axes"]["model"] == "inside a node"
    # hsdp gathers inside a node and sends only its gradients' reduction across; fsdp's gathers cross too
    hsdp, fsdp = by[("hsdp", (2, 4))], by[("fsdp", (8, 1))]
    assert hsdp["axes"] == {"data": "across nodes", "fsdp": "inside a node"}
    assert hsdp["collectives"]["all-gather"]["network_bytes"] == 0 < fsdp["collectives"]["all-gather"]["network_bytes"]
    assert 0 < hsdp["network_bytes"] == hsdp["collectives"]["all-reduce"]["network_bytes"]
    assert "hsdp, pipeline, pipeline-fsdp: no measured run yet" in " ".join(plan["assumptions"])
    # pipeline: activations cross (permutes), and of the gradients only the shell's (the blocks' stay on their
    # stage); every stage's FLOPs are counted, its bubble too
    pipeline = by[("pipeline", (2, 4))]
    assert pipeline["axes"] == {"stage": "across nodes", "data": "inside a node"}
    assert pipeline["collectives"]["collective-permute"]["network_bytes"] > 0

    def across(row, kind):
        return row["collectives"].get(kind, {}).get("network_bytes", 0)

    # data's gradients are reduced across the nodes (an all-reduce, or on GPUs a reduce-scatter where it is
    # sliced); the pipeline's only for the shell, and its last stage's outputs cross once, split between the
    # stages (a reduce-scatter) for each to run the head on its own rows
    data_reduction = across(by[("data", (8, 1))], "all-reduce") + across(by[("data", (8, 1))], "reduce-scatter")
    assert 0 < across(pipeline, "all-reduce") < data_reduction / 2
    assert across(pipeline, "reduce-scatter") > 0
    assert pipeline["flops_per_step"] > by[("data", (8, 1))]["flops_per_step"]
    # fsdp within a stage: a quarter of the state a GPU, its gathers inside a node
    split = by[("pipeline-fsdp", (2, 4))]
    assert split["state_bytes_per_device"] < 0.35 * pipeline["state_bytes_per_device"]
    assert split["collectives"]["all-gather"]["nvlink_bytes"] > 0
    assert plan["candidates"][plan["best"]]["params"]
    page = (out / "plan.html").read_text()
    assert "<svg" in page and "none of it assumed hidden" in page
    # each row names its largest term, and the plan its expected error on measured runs across hosts
    assert {r["dominant"] for r in ranked} <= {"compute", "NVLink", "network"} and by[("data", (8, 1))]["dominant"]
    assert any(a.startswith("expected error of a step time: ") for a in plan["assumptions"])
    assert "rank" in proc.stdout and "plan.html" in proc.stdout


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--gpu", "h10"], "(did you mean h100?)"),
        (["--gpu", "l40s", "--gpu-memory-gb", "48"], "--gpu-tflops, --nvlink-gbps"),
        (["--strategy", "data", "--batch-size", "3"], "not divisible by the data axis of any candidate"),
        (["--gpu-tflops", "-1"], "--gpu-tflops must be > 0"),
        (["--model-parallel", "3"], "--model-parallel 3 does not divide"),
        (["--nodes", "0"], "must be >= 1"),
        (["--network-gbps", "0"], "--network-gbps must be > 0"),
        (["--strategy", "pipeline", "--nodes", "1", "--gpus-per-node", "1"], "pipeline several GPUs"),
        (["--strategy", "data,nosuch"], "unknown strategy 'nosuch'; use all, or names separated by commas"),
        (["--network-from", "/nonexistent/doctor.json"], "cannot read it"),
        (["--network-from", "{tmp}/plain.json"], "holds no link measurements: run the doctor with --network"),
        (["--network-from", "{tmp}/plain.json", "--network-gbps", "10"], "both set the network figure; keep one"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, argv, words):
    (tmp_path / "plain.json").write_text(json.dumps({"ok": True, "checks": []}))  # a doctor run without --network
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    base = ["plan", "--preset", "gpt-small", "--nodes", "2", "--gpus-per-node", "4", "--out", str(tmp_path)]
    args = base + argv
    if "--nodes" in argv:
        args = ["plan", "--preset", "gpt-small", "--gpus-per-node", "4", "--out", str(tmp_path)] + argv
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_a_pipeline_named_on_one_node_is_planned_with_two_stages_and_all_leaves_it_out():
    from alpa_job.planner.candidates import plan_candidates

    named, _ = plan_candidates(1, 2, 32, ("data", "pipeline"), micro_batches=4)
    assert named == [("data", (2, 1)), ("pipeline", (2, 1))]
    every, _ = plan_candidates(1, 2, 32, None)
    assert every and not [s for s, _ in every if s.startswith("pipeline")]
    across, _ = plan_candidates(2, 1, 32, ("pipeline",))
    assert across == [("pipeline", (2, 1))]  # one stage a node, listed once


def test_prefilter_drops_what_cannot_fit_or_is_slow():
    from alpa_job.strategies import auto_candidates
    from alpa_job.planner.plan import job_config
    from alpa_job.planner.prefilter import predict_candidates, sort_out

    values = {k: v for k, v in TINY_GPT.items() if k not in ("num_samples", "dataset", "compile_cache")}
    config = job_config(({}, {}), values)
    import numpy as np

    example = {"tokens": np.zeros((16, 33), np.int32), "mask": np.ones((16,), np.float32)}
    candidates = auto_candidates(8)
    # drop_candidates is these two: the candidates compiled and predicted once, then sorted out per budget
    predictions = predict_candidates(config, None, example, candidates, nodes=2, gpus_per_node=4)
    kept, dropped = sort_out(predictions, budget_bytes=10**12, devices=8)
    assert kept and len(kept) + len(dropped) == len(candidates)
    assert all("planner: predicted" in d["note"] for d in dropped)
    tight, dropped_tight = sort_out(predictions, budget_bytes=1, devices=8)
    assert tight == [] and all("budget" in d["note"] for d in dropped_tight)


def test_plan_schema_matches_the_record_and_shares_the_report_leaf():
    import dataclasses

    from alpa_job.record import plan_record
    from alpa_job.record.run_record import load_schema

    schema = load_plan_schema()
    assert schema["$defs"]["leaf"]["properties"] == load_schema()["$defs"]["leaf"]["properties"]
    assert set(schema["required"]) == {f.name for f in dataclasses.fields(plan_record.PlanRecord)}
    for name, cls in (
        ("candidate", plan_record.PlanCandidate),
        ("cluster", plan_record.PlanCluster),
        ("gpu", plan_record.PlanGpu),
        ("collective", plan_record.PlanCollective),
    ):
        assert set(schema["$defs"][name]["properties"]) == {f.name for f in dataclasses.fields(cls)}, name
