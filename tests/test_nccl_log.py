"""NCCL's INFO log read into transports and verdicts (alpa_job/cluster/doctor/nccl_log.py).

Real logs come from tests/data/nccl/ (its README says which run printed each). Line formats no real
run here printed are written inline, each beside the NCCL source line that prints it, cited from
NVIDIA/nccl at commit 5067397c2676d5aed50042fc39e5c8ee96eb0027 (the prefix: src/debug.cc,
"%s:%d:%d " hostname, pid, tid, then "[%d] NCCL INFO %s").
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from alpa_job.cli import main as cli_main
from alpa_job.cluster.doctor import nccl_log
from alpa_job.errors import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USER_ERROR, KitError

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "nccl")
SOCKETS_TWO_HOSTS = os.path.join(DATA, "sockets-two-hosts.log")
P2P_ONE_HOST = os.path.join(DATA, "p2p-one-host.log")
TWO_HOSTS_TWO_GPUS = os.path.join(DATA, "two-hosts-two-gpus.log")
PY39 = "/root/.pyenv/versions/3.9.18/bin/python"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two hosts on InfiniBand, as NCCL prints it:
IB_TWO_HOSTS = """\
gpu-a:4100:4100 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
gpu-a:4100:4180 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.1<0>
gpu-a:4100:4180 [0] NCCL INFO Using network IB
gpu-a:4100:4180 [0] NCCL INFO comm 0x55f2a1 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0
gpu-a:4100:4190 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu-a:4100:4190 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0(1)/GDRDMA
gpu-a:4100:4190 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:4100:4180 [0] NCCL INFO 24 coll channels, 24 collnet channels, 16 nvls channels, 32 p2p channels, 32 p2p channels per peer
"""
# src/init.cc:702 INFO(NCCL_ALL, "%s", VERSION_STRING); src/transport/net_ib/init.cc:513
# "NET/IB : Using%s %s; OOB %s:%s"; src/init.cc:486 "Using network %s"; src/init.cc:1422 "comm %p rank %d
# nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d"; src/transport/net.cc:324/328/377 "Channel %02d/%d :
# %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s" (and "/%d(%d)" through a proxy rank); src/transport/p2p.cc:423
# "via P2P/%s%s%s"; src/init.cc:1646 "%d coll channels, %d collnet channels, %d nvls channels, ...".


def _parse(text: str) -> nccl_log.NcclSummary:
    return nccl_log.parse_lines(text.splitlines())


# ---- parsing: the real socket log -------------------------------------------------------------------
def test_real_sockets_log_two_processes_on_lo():
    s = nccl_log.read_logs([SOCKETS_TWO_HOSTS])
    assert s.versions == ["2.28.9+cuda13.0"]
    assert [(p.host, p.pid) for p in s.processes] == [("vm", 1589), ("vm", 1587)]
    assert s.channels() == {"NET/Socket": 16}  # the run's own record counted 16 too
    for p in s.processes:
        assert p.details == {"NET/Socket/0": 4, "NET/Socket/0/Shared": 4}
        assert p.networks == ["Socket"] and p.failed_networks == ["IB"]
        assert p.ib_errors == ["transport/net_ib.cc:852 -> 3"] and p.ib_failed
        assert p.socket_ifaces == [("lo", "127.0.0.1")]
        assert p.env == {"NCCL_SOCKET_IFNAME": "lo", "NCCL_P2P_DISABLE": "1"}
        assert (p.n_nodes, p.n_ranks, p.local_ranks) == (2, 2, 1)
    assert s.n_nodes() == 2 and s.lines == 176
    assert nccl_log.transports_line(s) == "NCCL 2.28.9: 16 channels NET/Socket (lo), 2 nodes; IB did not initialise"


def test_real_samples_p2p_within_a_node_and_sockets_across():
    s = nccl_log.read_logs([TWO_HOSTS_TWO_GPUS])
    assert s.channels() == {"P2P": 4, "NET/Socket": 8}
    assert s.processes[0].details == {"P2P/direct pointer": 4}
    assert nccl_log.transports_line(s) == "NCCL: 8 channels NET/Socket, 4 P2P"


# ---- parsing: formats from NCCL's source ------------------------------------------------------------
def test_ib_devices_oob_nodes_and_nvls():
    s = _parse(IB_TWO_HOSTS)
    (p,) = s.processes
    assert p.ib_devices == ["mlx5_0:1/IB", "mlx5_1:1/IB"] and p.ib_oob == ("eth0", "10.0.0.1")
    assert p.networks == ["IB"] and not p.ib_failed
    assert p.channels == {"NET/IB": 2, "P2P": 1, "NVLS": 16}
    assert p.details == {"NET/IB/0/GDRDMA": 1, "NET/IB/0(1)/GDRDMA": 1, "P2P/CUMEM/read": 1}
    assert (p.n_nodes, p.n_ranks, p.local_ranks) == (2, 16, 8)
    assert nccl_log.transports_line(s) == "NCCL 2.21.5: 16 channels NVLS, 2 NET/IB (mlx5_0:1/IB, mlx5_1:1/IB), 1 P2P, 2 nodes"


@pytest.mark.parametrize(
    "detail, kind",
    [
        ("NET/Socket/0", "NET/Socket"),
        ("NET/Socket/0/Shared", "NET/Socket"),
        ("NET/IB/0/GDRDMA", "NET/IB"),
        ("NET/IBext_v8/1/GDRDMA", "NET/IB"),
        ("NET/Libfabric/0", "NET/Libfabric"),
        ("P2P/CUMEM", "P2P"),
        ("P2P/IPC", "P2P"),
        ("P2P/direct", "P2P"),
        ("P2P/indirect/1[1]", "P2P"),
        ("SHM/direct", "SHM"),
    ],
)
def test_transport_kinds(detail, kind):
    assert nccl_log.transport_kind(detail) == kind


def test_shm_ipc_and_older_channel_format():
    # src/transport/shm.cc:116 "Channel %02d : %d[%d] -> %d[%d] via SHM/direct" (no connection index);
    # src/transport/p2p.cc:429 "via P2P/IPC%s%s"; NCCL before the connection index: "Channel 00 : 0[1b000] -> ...".
    s = _parse(
        "h:1:1 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct\n"
        "h:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/IPC/read\n"
        "h:1:1 [0] NCCL INFO Channel 00 : 0[1b000] -> 1[43000] via P2P/CUMEM\n"
        "h:1:1 [0] NCCL INFO Channel 00/02 : 0 1\n"
    )  # a ring, no transport
    assert s.channels() == {"SHM": 1, "P2P": 2}


def test_ibext_plugin_and_ib_failures():
    # src/plugin/net.cc:208 "Failed to initialize NET plugin %s"; src/transport/net_ib/init.cc:470
    # "NET/IB : No device found."; the nccl-rdma-sharp plugin names itself IBext_v<N>.
    s = _parse(
        "a:7:7 [0] NCCL INFO Using network IBext_v8\n"
        "a:7:7 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IBext_v8/0/GDRDMA\n"
        "b:8:8 [0] NCCL INFO NET/IB : No device found.\n"
        "c:9:9 [0] NCCL INFO Failed to initialize NET plugin IB\n"
    )
    a, b, c = s.processes
    assert a.networks == ["IBext_v8"] and a.channels == {"NET/IB": 1}
    assert b.ib_no_device and b.ib_failed and c.ib_failed and not a.ib_failed
    # The SHARP plugin failing while NCCL's own IB works: IB is up.
    fallback = _parse(
        "d:1:1 [0] NCCL INFO Failed to initialize NET plugin IBext_v8\n"
        "d:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB eth0:10.0.0.4<0>\n"
        "d:1:1 [0] NCCL INFO Using network IB\n"
    )
    assert not fallback.processes[0].ib_failed
    assert "IB did not initialise" not in nccl_log.transports_line(fallback)


def test_env_overrides_both_wordings():
    # src/misc/param.cc:100 "%s set by environment to %lld."; src/misc/socket.cc:201 "NCCL_SOCKET_IFNAME set to %s";
    # older NCCL (socket.cc:199) "NCCL_SOCKET_IFNAME set by environment to %s".
    s = _parse(
        "h:1:1 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.\n"
        "h:1:1 [0] NCCL INFO NCCL_SOCKET_IFNAME set to eth0\n"
        "g:2:2 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to ib0\n"
    )
    assert s.processes[0].env == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}
    assert s.processes[1].env == {"NCCL_SOCKET_IFNAME": "ib0"}


def test_prefixes_ray_timestamps_and_repeats():
    # Ray's log stream puts "(ACTOR pid=N, ip=IP)" first and folds repeats; NCCL_DEBUG_TIMESTAMP_FORMAT
    # puts "[%F %T] " before the hostname (src/debug.cc).
    s = _parse(
        "(JaxProcess pid=1589, ip=10.0.0.2) vm:1589:1646 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] "
        "[send] via NET/Socket/0 [repeated 3x across cluster]\n"
        "(JaxProcess pid=77) vm2:77:78 [1] NCCL INFO Using network Socket\n"
        "[2026-11-28 20:28:24] vm3:5:6 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"
        "NCCL version 2.28.9+cuda13.0\n"  # the version line has no prefix (debug.cc: NCCL_LOG_VERSION)
        "unrelated line\n"
    )
    assert [p.where for p in s.processes] == ["vm (10.0.0.2)", "vm2", "vm3"]
    assert s.processes[0].details == {"NET/Socket/0": 1} and s.processes[1].networks == ["Socket"]
    assert s.versions == ["2.28.9+cuda13.0"] and s.lines == 3


def test_no_lines_says_how_to_get_them(tmp_path):
    empty = tmp_path / "train.log"
    empty.write_text("step 1 loss 2.0\n")
    s = nccl_log.read_logs([str(empty)])
    assert not s.processes and nccl_log.verdicts(s, "ib") == []
    assert "NCCL_DEBUG=INFO" in nccl_log.transports_line(s)


def test_run_summary_reads_a_run_directory_and_a_file_list(tmp_path):
    (tmp_path / "node-a").mkdir()
    (tmp_path / "node-a" / "worker-1.out").write_text(open(SOCKETS_TWO_HOSTS).read())
    (tmp_path / "report.json").write_text("{}")
    assert nccl_log.run_summary(str(tmp_path)).channels() == {"NET/Socket": 16}
    assert nccl_log.run_summary([SOCKETS_TWO_HOSTS, P2P_ONE_HOST]).channels() == {"NET/Socket": 16, "P2P": 4}
    with pytest.raises(KitError, match="does not exist"):
        nccl_log.run_summary(str(tmp_path / "missing.log"))


# ---- verdicts --------------------------------------------------------------------------------------
def test_real_log_on_ib_fell_back_to_sockets_on_loopback():
    found = nccl_log.verdicts(nccl_log.read_logs([SOCKETS_TWO_HOSTS]), "ib")
    assert len(found) == 2  # both processes are on host vm: one line per problem
    assert found[0].startswith("NCCL fell back to sockets on vm: IB did not initialise")
    assert "/dev/infiniband" in found[0] and "IPC_LOCK" in found[0] and "fabric ib" in found[0]
    assert found[1] == (
        "NCCL uses sockets on the loopback interface lo on vm (NCCL_SOCKET_IFNAME=lo there): "
        "across hosts set NCCL_SOCKET_IFNAME to the cluster interface"
    )


def test_real_log_on_ethernet_only_the_loopback():
    found = nccl_log.verdicts(nccl_log.read_logs([SOCKETS_TWO_HOSTS]), "ethernet", host="10.0.0.2")
    assert found == [
        "NCCL uses sockets on the loopback interface lo on 10.0.0.2 (NCCL_SOCKET_IFNAME=lo there): "
        "across hosts set NCCL_SOCKET_IFNAME to the cluster interface"
    ]


def test_ib_disable_on_an_ib_cluster_names_the_variable():
    s = _parse(
        "h1:1:1 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.\n"
        "h1:1:1 [0] NCCL INFO Using network Socket\n"
        "h1:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\n"
        "h1:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0\n"
    )
    assert nccl_log.verdicts(s, "roce") == ["NCCL_IB_DISABLE=1 is set on h1 while the cluster declares fabric roce: remove it"]
    assert nccl_log.verdicts(s, "ethernet") == []  # sockets on a real interface: the explicit choice


def test_sockets_on_ib_without_an_ib_failure_line():
    found = nccl_log.verdicts(nccl_log.read_logs([TWO_HOSTS_TWO_GPUS]), "ib")
    assert len(found) == 1  # P2P-only vm:5727 is no problem; the socket processes are, on one host
    assert found[0].startswith("NCCL uses sockets on vm though the cluster declares fabric ib")


def test_no_verdict_within_one_node_or_on_ib():
    p2p = nccl_log.read_logs([P2P_ONE_HOST])
    assert nccl_log.transports_line(p2p) == "NCCL: 4 channels P2P"
    # SHM and NVLS within one node, NCCL's network Socket initialised but unused (nNodes 1):
    one_node = _parse(
        "h:1:1 [0] NCCL INFO Failed to initialize NET plugin IB\n"
        "h:1:1 [0] NCCL INFO Using network Socket\n"
        "h:1:1 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>\n"
        "h:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 8 nNodes 1 localRanks 8 localRank 0 MNNVL 0\n"
        "h:1:1 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct\n"
        "h:1:1 [0] NCCL INFO 2 coll channels, 2 collnet channels, 16 nvls channels, 2 p2p channels\n"
    )
    for fabric in nccl_log.FABRICS:
        assert nccl_log.verdicts(p2p, fabric) == []
        assert nccl_log.verdicts(one_node, fabric) == []
        assert nccl_log.verdicts(_parse(IB_TWO_HOSTS), fabric) == []


def test_p2p_disabled_with_several_gpus_in_a_node():
    s = _parse(
        "h:1:1 [0] NCCL INFO NCCL_P2P_DISABLE set by environment to 1\n"
        "h:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 8 nNodes 1 localRanks 8 localRank 0 MNNVL 0\n"
    )
    (found,) = nccl_log.verdicts(s, "ethernet")
    assert found.startswith("NCCL_P2P_DISABLE=1 is set on h, which has 8 GPUs")


def test_hosts_with_the_same_problem_share_one_line():
    log = "".join("%s:1:1 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.\n" % h for h in ("a", "b", "a"))
    assert nccl_log.verdicts(_parse(log), "ib") == ["NCCL_IB_DISABLE=1 is set on a, b while the cluster declares fabric ib: remove it"]


def test_unknown_fabric_names_the_allowed_ones():
    with pytest.raises(KitError, match="ib, roce, ethernet"):
        nccl_log.verdicts(nccl_log.NcclSummary(), "infiniband")


# ---- the doctor's CLI ------------------------------------------------------------------------------
def test_doctor_nccl_log_cli_on_the_real_log(capsys):
    assert cli_main(["doctor", "--nccl-log", SOCKETS_TWO_HOSTS, "--fabric", "ib"]) == EXIT_CHECK_FAILED
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "NCCL 2.28.9: 16 channels NET/Socket (lo), 2 nodes; IB did not initialise"
    assert len(out) == 3 and out[1].startswith("FAIL NCCL fell back to sockets on vm")
    assert cli_main(["doctor", "--nccl-log", P2P_ONE_HOST, "--fabric", "ib"]) == EXIT_OK
    assert "NCCL: 4 channels P2P" in capsys.readouterr().out


def test_doctor_nccl_log_json_and_the_spec_fabric(capsys, tmp_path):
    # No --fabric and a spec without network.fabric: ethernet, so only the loopback verdict.
    assert cli_main(["doctor", "--nccl-log", SOCKETS_TWO_HOSTS, "--format", "json"]) == EXIT_CHECK_FAILED
    data = json.loads(capsys.readouterr().out)
    assert data["fabric"] == "ethernet" and not data["ok"] and len(data["verdicts"]) == 1
    assert data["summary"]["channels_by_transport"] == {"NET/Socket": 16}
    assert data["transports"].startswith("NCCL 2.28.9")


def test_doctor_nccl_log_without_nccl_lines_is_bad_input(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text("no NCCL here\n")
    assert cli_main(["doctor", "--nccl-log", str(log)]) == EXIT_USER_ERROR
    assert "NCCL_DEBUG=INFO" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists(PY39), reason="no Python 3.9 interpreter at " + PY39)
def test_parses_on_python39():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from alpa_job.cluster.doctor import nccl_log as n; "
        "s = n.read_logs([sys.argv[2]]); print(n.transports_line(s)); print(len(n.verdicts(s, 'ib')))"
    )
    p = subprocess.run([PY39, "-c", code, REPO, SOCKETS_TWO_HOSTS], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["NCCL 2.28.9: 16 channels NET/Socket (lo), 2 nodes; IB did not initialise", "2"]
