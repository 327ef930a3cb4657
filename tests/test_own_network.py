"""A multi-process run's own network in its report: NCCL's transports read from each process's own log (real
lines of two H200 processes held to sockets), the verdicts for the declared fabric, and the report's line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jsonschema

from alpa_job.progress.events import set_sink
from alpa_job.cluster import network_probe
from alpa_job.record.run_record import RunRecord, load_schema
from alpa_job.train import own_network

SOCKETS_LOG = Path(__file__).parent / "data" / "nccl" / "sockets-two-hosts.log"


class _Config:
    def __init__(self, spec_path):
        self.cluster_spec = str(spec_path)


def test_a_process_reads_its_own_nccl_lines_and_says_when_ib_was_declared(tmp_path, monkeypatch):
    own = tmp_path / "alpa_job-nccl.host.1.log"
    shutil.copy(SOCKETS_LOG, own)
    monkeypatch.setattr(network_probe, "own_nccl_log", lambda: str(own))
    spec = tmp_path / "cluster.yaml"
    spec.write_text("network:\n  fabric: ib\n")
    notes = []
    set_sink(lambda event: notes.append(event.get("text")) if event["kind"] == "note" else None)
    try:
        nccl = own_network._nccl(_Config(spec))
    finally:
        set_sink(None)
    assert nccl["channels"] == {"NET/Socket": 16} and "NET/Socket" in nccl["transports"]
    assert any("fell back to sockets" in v for v in nccl["verdicts"]), nccl
    assert [n for n in notes if n and "fell back to sockets" in n]  # said in the progress output, at the start
    spec.write_text("network:\n  fabric: ethernet\n")
    calm = own_network._nccl(_Config(spec))
    assert not any("fell back" in v for v in calm["verdicts"])

    record = RunRecord(engine="jax", strategy="data")
    record.network_measured = {"backend": "gpu", "devices": 2, "processes": 2, "bytes": 32 << 20, "seconds": 0.0224, "bus_gbps": 11.98}
    record.process.nccl = nccl
    record.processes = [record.process]
    from alpa_job.inspect.render import measured_network_text

    text = measured_network_text(record)
    assert text.startswith("all-reduce of 32.0 MiB a device over 2 gpu device(s): 11.98 Gb/s bus bandwidth")
    assert "NET/Socket" in text and "process 0: NCCL fell back to sockets" in text
    schema, report = load_schema(), record.to_dict()
    jsonschema.validate(report["network_measured"], schema["properties"]["network_measured"])
    jsonschema.validate(report["processes"][0], {**schema["$defs"]["process"], "$defs": schema["$defs"]})


def test_a_run_measures_its_links_when_it_has_any():
    """Several processes always; one process only over several GPUs (NCCL between them); one process's CPU
    devices share its memory, and one GPU has nothing to talk to."""
    assert own_network.worth_measuring("cpu", 3, 3)
    assert own_network.worth_measuring("gpu", 2, 2)
    assert own_network.worth_measuring("gpu", 1, 2)
    assert not own_network.worth_measuring("gpu", 1, 1)
    assert not own_network.worth_measuring("cpu", 1, 8)


def test_a_process_takes_the_socket_settings_its_node_lacks_and_keeps_its_own(monkeypatch):
    """What a training process and the doctor's probes do before NCCL starts: the cluster's NCCL socket
    settings fill what the node's environment lacks (a `ray start` by hand), never replacing the node's own."""
    keys = ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")
    for key in keys:  # recorded by monkeypatch, so whatever prepare_nccl sets is undone after the test
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.setenv("NCCL_NSOCKS_PERTHREAD", "2")
    log = network_probe.prepare_nccl()
    assert os.environ["NCCL_SOCKET_NTHREADS"] == "4" and os.environ["NCCL_NSOCKS_PERTHREAD"] == "2"
    assert os.environ["NCCL_P2P_NET_CHUNKSIZE"] == "524288"
    assert log == network_probe.own_nccl_log() and os.environ["NCCL_DEBUG"] == "INFO"
