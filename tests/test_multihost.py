"""Training across hosts on the test bed: `ray job submit` from the head and from a worker, and the
addresses the kit used (every JAX process's IP is its own host's; the coordinator is the head's)."""

import concurrent.futures
import json
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest
from kit_testbed import hosts as testbed_lib
from helpers_report import assert_valid_report, read_events

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

_NODE_IPS = r"""
import json, os
from alpa_job.cluster import ray_api
ray_api.join_ray(os.environ["RAY_ADDRESS"], log_to_driver=False)
print("NODES " + json.dumps([n.ip for n in ray_api.alive_nodes()]))
"""

_JOBS = {}  # (host, extra train flags) -> (report, seconds, CompletedProcess): each job runs once a session


def _run_folder(host: str) -> Path:
    return Path("/tmp") / ("akt-multihost-%s-%s" % (host, uuid.uuid4().hex[:8]))


def _job(ray_cluster, host: str, *train_flags: str, out: Optional[Path] = None):
    """`ray job submit` from `host` of a 5-step MLP run over the cluster: (its run folder, the finished
    submit). /tmp outside /tmp/ray is the machine's /tmp, shared by every host: the driver (on the head
    under `ray job submit`) writes the report there and the test reads it from outside."""
    out = out or _run_folder(host)
    p = ray_cluster.testbed.exec(
        host,
        "ray",
        "job",
        "submit",
        "--address",
        "http://%s:%d" % (ray_cluster.head_ip, ray_cluster.spec.ports["dashboard"]),
        "--",
        "python",
        "-m",
        "alpa_job",
        "train",
        "--model",
        "mlp",
        "--steps",
        "5",
        "--devices",
        "2",
        "--batch-size",
        "96",
        "--cluster-spec",
        str(ray_cluster.spec_path),
        "--out",
        str(out),
        *train_flags,
        timeout=400,
        check=False,
    )
    return out, p


def _submit(ray_cluster, host: str, *train_flags: str):
    key = (host,) + train_flags
    if key in _JOBS:
        return _JOBS[key]
    t0 = time.monotonic()
    out, p = _job(ray_cluster, host, *train_flags)
    seconds = time.monotonic() - t0
    assert p.returncode == 0, "ray job submit from %s failed:\n%s\n%s" % (host, p.stdout[-5000:], p.stderr[-3000:])
    report = json.loads((out / "report.json").read_text())
    assert_valid_report(report)  # a multi-process report too matches the shipped schema
    _JOBS[key] = (report, seconds, p)
    return _JOBS[key]


def _check_report(ray_cluster, report):
    bed = ray_cluster.testbed
    s = report["summary"]
    assert s["devices"] == 6 and s["processes"] == 3 and s["hosts"] == 3
    assert report["compiles"] == 1 and s["one_compile"] is True
    assert report["strategy"] == "data" and report["steps"] == 5
    network = report["network_traffic"]  # data's gathers and reduce-scatters span the three hosts
    assert network["hosts"] == 3 and network["across_hosts_bytes"] > 0 and network["within_host_bytes"] > 0
    assert network["collectives_across_hosts"] > 0 and network["groups_read"], network
    # ... and what they measured before the first step: an all-reduce over the six devices of three hosts
    measured = report["network_measured"]
    assert measured["devices"] == 6 and measured["processes"] == 3 and measured["bus_gbps"] > 0, measured
    coordinator = "%s:%d" % (ray_cluster.head_ip, ray_cluster.spec.jax_coordinator_port)
    procs = sorted(report["processes"], key=lambda p: p["id"])
    assert [p["id"] for p in procs] == [0, 1, 2]
    assert procs[0]["ip"] == ray_cluster.head_ip  # process 0 (the coordinator) on the driver's node
    for p in procs:
        assert p["ip"] == bed.ips[p["host"]], p  # every process's IP is its own host's
        assert p["coordinator"] == coordinator and p["count"] == 3 and len(p["local_devices"]) == 2
    assert sorted(p["host"] for p in procs) == sorted(bed.ips)


def test_job_submit_from_head(ray_cluster):
    report, seconds, p = _submit(ray_cluster, "head")
    _check_report(ray_cluster, report)
    assert "succeeded" in p.stdout + p.stderr
    assert "[alpa_job] network: all-reduce of 4 MiB a device over 6 cpu device(s)" in p.stdout + p.stderr


def test_job_submit_from_a_worker(ray_cluster):
    first, _, _ = _submit(ray_cluster, "head")
    report, seconds, p = _submit(ray_cluster, "w1")
    _check_report(ray_cluster, report)  # asserts the 3-host, 3-process, one-compile run
    assert "succeeded" in p.stdout + p.stderr  # ray job submit itself reported success from w1
    # The same job a second time: every process loads its own stored step (JAX's cache would have served
    # process 0 alone), and trains the same numbers.
    assert [q["step_source"] for q in report["processes"]] == ["stored"] * 3, report["processes"]
    assert report["losses"] == first["losses"]


# A compile cache of this session's own (so the search runs, and saves its table for the test after it).
AUTO = ("--strategy", "auto", "--auto-trial-steps", "1", "--compile-cache", "/tmp/akt-multihost-cache-%s" % uuid.uuid4().hex[:8])


def test_auto_on_three_hosts_tries_only_meshes_each_process_can_feed_and_agrees_on_one_winner(ray_cluster):
    """Six devices in three processes, each reading its own third of the batch: a tensor mesh whose model
    axis spans processes (2x3, 1x6) would need rows another process read (it used to fail the run:
    "Invalid host data"), so auto tries tensor only inside a host, hsdp as hosts x their devices, and
    pipeline (and pipeline-fsdp) a stage a host (refused in its row: the MLP declares no repeated blocks).
    The four others are timed, and
    every process takes process 0's times, so all train the one winner (processes on different programs
    would hang each other)."""
    report, _, _ = _submit(ray_cluster, "head", *AUTO)
    table = report["search"]
    assert report["summary"]["processes"] == 3 and report["steps"] == 5
    timed = [row for row in table if row["step_time_s"]]
    assert sorted((row["strategy"], tuple(row["mesh_shape"])) for row in table) == [
        ("data", (6, 1)),
        ("fsdp", (6, 1)),
        ("hsdp", (3, 2)),
        ("pipeline", (3, 2)),
        ("pipeline-fsdp", (3, 2)),
        ("tensor", (3, 2)),
    ], table
    assert len(timed) == 4, table
    for pipeline in (row for row in table if row["strategy"].startswith("pipeline")):  # a stage a host, but
        assert "declares none" in pipeline["note"] and not pipeline["step_time_s"], pipeline  # no MLP blocks
    chosen = [row for row in table if row["chosen"]]
    assert len(chosen) == 1 and chosen[0]["step_time_s"] == min(row["step_time_s"] for row in timed)
    assert report["strategy"] == chosen[0]["strategy"] and report["mesh"]["shape"] == chosen[0]["mesh_shape"]


def test_auto_on_copies_on_three_hosts_every_process_ranks_alike_and_trains_one_winner(ray_cluster):
    """Ranking on shallow copies across processes: the copies' steps run in one order on every process,
    the likeliest winner compiles in the background on each, and the predictions are process 0's, so all
    three train the same winner (a disagreement would hang the run, not fail it). One device a host keeps
    it to the two candidates that need no second device in a host (data, fsdp): what crosses processes is
    the same for two candidates as for four."""
    report, _, _ = _submit(
        ray_cluster,
        "head",
        "--model",
        "gpt",
        "--num-layers",
        "6",
        "--d-model",
        "32",
        "--num-heads",
        "4",
        "--seq-len",
        "16",
        "--vocab-size",
        "64",
        "--strategy",
        "auto",
        "--auto-rank-on",
        "copies",
        "--auto-trial-steps",
        "1",
        "--compile-cache",
        "none",
        "--devices",
        "1",
    )
    assert report["summary"]["processes"] == 3 and report["steps"] == 5
    timed = [row for row in report["search"] if row["step_time_s"]]
    assert len(timed) == 2 and all(row["predicted_from"] == [1, 3] for row in timed), report["search"]
    for pipeline in (row for row in report["search"] if row["strategy"].startswith("pipeline")):  # (3, 1)
        assert "not ranked on copies" in pipeline["note"], pipeline
    chosen = [row for row in report["search"] if row["chosen"]]
    fastest = min(row["step_time_s"] for row in timed)
    ties = [row for row in timed if row["step_time_s"] <= fastest * 1.03]  # shallow_ranking.TIE
    assert len(chosen) == 1 and chosen[0] in ties, report["search"]
    assert chosen[0]["peak_bytes_per_device"] == min(row["peak_bytes_per_device"] for row in ties)
    assert chosen[0]["whole_compile_s"] is not None
    assert report["strategy"] == chosen[0]["strategy"] and report["mesh"]["shape"] == chosen[0]["mesh_shape"]


def test_tensor_on_three_hosts_keeps_its_model_axis_inside_each_host(ray_cluster):
    """Each process reads only its own batch rows, so tensor's default model axis divides one host's
    devices: 3 hosts x 2 devices train on mesh 3x2. A --model-parallel that would span hosts is refused
    in one line before any JAX process starts."""
    report, _, _ = _submit(ray_cluster, "head", "--strategy", "tensor")
    assert report["strategy"] == "tensor" and report["mesh"]["shape"] == [3, 2], report["mesh"]
    assert report["summary"]["processes"] == 3 and report["steps"] == 5
    _, p = _job(ray_cluster, "head", "--strategy", "tensor", "--model-parallel", "3")
    assert p.returncode != 0
    assert "does not give each of the 3 processes its own rows of the batch" in p.stdout + p.stderr, p.stdout[-3000:]
    assert "JAX process" not in p.stdout + p.stderr  # refused before any started


def test_hsdp_on_three_hosts_shards_within_each_host_and_trains_as_data_does(ray_cluster):
    """Two-level: hsdp's mesh is hosts x their devices (3x2), its parameters split over each host's two
    devices only, so some of its collectives stay inside a host; it computes data's losses."""
    data, _, _ = _submit(ray_cluster, "head")
    report, _, _ = _submit(ray_cluster, "head", "--strategy", "hsdp")
    assert report["strategy"] == "hsdp" and report["mesh"] == {"shape": [3, 2], "axes": ["data", "fsdp"]}
    assert report["summary"]["processes"] == 3 and report["compiles"] == 1
    assert report["losses"] == pytest.approx(data["losses"], rel=1e-5)
    network = report["network_traffic"]
    assert network["hosts"] == 3 and 0 < network["collectives_across_hosts"] < network["collectives"], network


GPT3 = ("--model", "gpt", "--num-layers", "3", "--d-model", "32", "--num-heads", "4", "--seq-len", "16", "--vocab-size", "64")


def test_pipeline_across_three_hosts_runs_a_stage_on_each_and_trains_as_data_does(ray_cluster):
    """--strategy pipeline: one stage a host by default (GPT's 3 blocks, one on each), data parallel over
    each host's 2 devices, 12 micro-batches; the losses are data's on the same global batch."""
    data, _, _ = _submit(ray_cluster, "head", *GPT3)
    report, _, _ = _submit(ray_cluster, "head", *GPT3, "--strategy", "pipeline")
    assert report["mesh"] == {"shape": [3, 2], "axes": ["stage", "data"]}
    assert report["summary"]["processes"] == 3 and report["compiles"] == 1
    stages = report["pipeline"]["layers"]
    assert [row["blocks"] for row in stages] == [["DecoderBlock_0"], ["DecoderBlock_1"], ["DecoderBlock_2"]]
    assert [row["processes"] for row in stages] == [[0], [1], [2]]  # a stage a host
    assert report["pipeline"]["micro_batches"] == 12
    assert report["losses"] == pytest.approx(data["losses"], rel=1e-5)


def test_a_saved_search_that_only_some_hosts_have_is_searched_again_on_all(ray_cluster):
    """The same auto job again, now with w2's compile cache empty (a node that never ran it: a tmpfs over the
    folder in w2's own mount namespace; each node keeping its own cache is the default). Two processes
    reusing the saved search while w2 searched would run other programs than w2's and hang the job: every
    process searches again, and all train one winner."""
    first, _, _ = _submit(ray_cluster, "head", *AUTO)
    cache = AUTO[AUTO.index("--compile-cache") + 1]
    bed = ray_cluster.testbed
    bed.exec("w2", "mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", cache)
    try:
        out, p = _job(ray_cluster, "head", *AUTO)
    finally:
        bed.exec("w2", "umount", cache, check=False)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-5000:]
    report = json.loads((out / "report.json").read_text())
    w2 = next(q["id"] for q in report["processes"] if q["host"] == "w2")
    assert "the saved search is not the same on every process (process(es) [%d] have none" % w2 in text, text[-3000:]
    assert report["summary"]["processes"] == 3 and report["steps"] == 5
    assert not [row for row in report["search"] if "from the saved search" in row["note"]], report["search"]
    assert len([row for row in report["search"] if row["step_time_s"]]) == len([row for row in first["search"] if row["step_time_s"]])


def test_every_address_the_job_used_is_its_hosts_own(ray_cluster):
    """The seed failure was a worker binding the head's IP (errno 99, asserted in test_testbed's
    test_binding_another_hosts_ip_fails). Here, on a job that ran: the coordinator address is the
    head's own IP and the spec's port, and every process's address is the IP of the host that served
    it - none is another host's."""
    report, _, _ = _submit(ray_cluster, "head")
    bed = ray_cluster.testbed
    coordinator_ip, port = report["processes"][0]["coordinator"].rsplit(":", 1)
    assert coordinator_ip == bed.ips["head"] and int(port) == ray_cluster.spec.jax_coordinator_port
    lo, hi = ray_cluster.spec.ranges["xla_grpc"]
    assert lo <= int(port) <= hi  # inside the range the firewall opens
    served = {p["host"]: p["ip"] for p in report["processes"]}
    assert served == bed.ips
    for host, ip in served.items():
        # the address is really one of that host's own interfaces (bind works there) ...
        code = "import socket; s = socket.socket(); s.bind((%r, 0)); print('ok')" % ip
        assert bed.exec(host, "python", "-c", code).stdout.strip() == "ok"


def test_head_with_mgmt_nic_joins_by_cluster_cidr_address(mgmt_cluster):
    """The head's default route is on mgmt0 (192.168.77.x): Ray's own guess would pick that NIC. The kit
    started it with select_node_ip(cidr), run inside the head: Ray's node IP is the 10.77.0.x address."""
    bed = mgmt_cluster.testbed
    head = bed.host("head")
    assert head.mgmt_ip and "dev mgmt0" in bed.exec("head", "ip", "route", "show", "default").stdout
    assert mgmt_cluster.head_node_ip == head.ip
    p = bed.exec("head", "python", "-c", _NODE_IPS, env={"RAY_ADDRESS": mgmt_cluster.address}, timeout=120)
    nodes = json.loads([x for x in p.stdout.splitlines() if x.startswith("NODES ")][-1][6:])
    assert head.ip in nodes and head.mgmt_ip not in nodes


def _wait_for_line(path: Path, words: str, job, timeout_s: float) -> bool:
    """Whether `words` appeared in the file at `path` before `job` ended or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not job.done():
        if path.exists() and words in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


SMALL_MLP = ("--hidden-dim", "64", "--devices", "1")  # steps of a few ms of work: 300 of them are cheap
WINDOW = 20  # the slowed run's straggler window: each of its steps takes about a second on the held host
CLEAN_NOISE = 0.3  # the most a clean host may be named slower by; the slowed one must pass it


def test_a_slowed_host_is_named_within_a_window_and_a_clean_run_names_none(ray_cluster):
    """Stragglers: 300 steps on three clean hosts name nobody beyond noise (the default 50-step window); with w1's processes
    held to 0.05 of a CPU (a real cgroup quota), the run names process w1 - in the log, the progress line and
    the report - once a window (`--straggler-window 20`, so its slow steps stay few) is full of slow steps."""

    clean, _, _ = _submit(ray_cluster, "head", *SMALL_MLP, "--steps", "300")
    stragglers = clean["stragglers"]
    assert stragglers["every"] == 5 and stragglers["window_steps"] == 50
    assert stragglers["measure"]["kind"] == "cpu time + run-queue wait or quota throttling"
    assert sorted(u["host"] for u in stragglers["units"]) == sorted(ray_cluster.testbed.ips)
    print("clean run's own work a step, ms (each process's 50-step window at the end):", stragglers["latest"]["work_ms"])
    # Nobody named beyond noise. The hosts share two cores through their own cgroups, so a host with more
    # daemons busy waits longer for a core and can cross the rule's 10 % over a window now and then (once in
    # five suite runs: +10 %); the throttled host below is named at tens of times the others' work.
    assert all(e["event"] != "slow" or e["slower_by"] < CLEAN_NOISE for e in stragglers["events"]), stragglers["events"]

    # w1 starts (imports, compile) at 0.15 of a CPU, and runs its steps at 0.05: held back far more than a
    # busy 2-core machine's run-queue waits slow the others (at 0.15 all through, a loaded machine once
    # slowed the other two hosts more than the quota slowed w1).
    out = _run_folder("head")
    with testbed_lib.CpuQuota(ray_cluster.testbed, "w1", 0.15) as quota:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slowed = pool.submit(_job, ray_cluster, "head", *SMALL_MLP, "--straggler-window", str(WINDOW), "--steps", "36", out=out)
            stepping = _wait_for_line(out / "train.log", "[train] step ", slowed, timeout_s=300)
            if stepping:
                quota.set_cores(0.05)
            out, p = slowed.result()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert stepping, "the slowed run's train.log showed no step before it ended: %s" % (out / "train.log")
    report = json.loads((out / "report.json").read_text())
    assert_valid_report(report)
    print("slowed run: w1's quota", quota.throttled, "- the last window:", report["stragglers"]["latest"])
    assert quota.throttled["throttled"] > 0, quota.throttled  # the quota really held w1 back
    slow = [e for e in report["stragglers"]["events"] if e["event"] == "slow"]
    # The quota holds the whole host back: its devices are named, its input (the batches it makes) may be too
    # over a short window, and nobody else is.
    assert {e["host"] for e in slow} == {"w1"}, report["stragglers"]["events"]
    devices = [e for e in slow if e["what"] == "devices"]
    assert len(devices) == 1, report["stragglers"]["latest"]
    named = devices[0]
    # Never before a window is full; once the quota holds (from the first step line on), within its rounds.
    assert WINDOW <= named["step"] <= WINDOW + 15 and named["slower_by"] >= CLEAN_NOISE, named
    assert report["stragglers"]["window_steps"] == WINDOW
    assert any(s.startswith("process %d on w1 +" % named["process"]) for s in report["stragglers"]["slow_now"])
    log = p.stdout + p.stderr
    assert "straggler: process %d (host w1): its own work takes" % named["process"] in log, log[-3000:]
    assert "slow: process %d on w1 +" % named["process"] in log, log[-3000:]  # the progress line
    scalars, texts = read_events(out / "tensorboard")
    assert max(v for _, v in scalars["stragglers/slowest_ratio"]) >= 1.3, scalars["stragglers/slowest_ratio"]
    assert "process %d (w1) devices +" % named["process"] in texts["stragglers"], texts
    assert "all-reduce of" in texts["network"], texts
