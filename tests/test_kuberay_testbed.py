"""KubeRay's own `ray start` command lines, from the cpu-smoke overlay, on 3 test-bed hosts, under the
NetworkPolicy as a firewall: the cluster forms and `doctor` is green.

What is emulated, and how (each host of the bed stands for one pod: head, w1 = cpu worker 0, w2 = worker 1):

* the manifests are `kubectl kustomize k8s/overlays/cpu-smoke` (the GPU-less variant: no GPUs here);
* the container's command is KubeRay's, built by alpa_job.cluster.kuberay from the rendered RayCluster
  (rayStartParams as strings, "true" -> bare flag, --address for workers, --block,
  --metrics-export-port=8080, --dashboard-agent-listen-port=52365, --num-cpus / --memory from the limits)
  and run the way the pod runs it: `/bin/bash -c -- "ulimit -n ...; ray start ... --block"`, in the
  background (Popen), since --block keeps it in the foreground as in a pod;
* `$(MY_POD_IP)` (status.podIP) is each host's bed IP; the container's env (NCCL_*, XLA_*, ...) is set;
* workers' `--address` is `alpa-head-svc.default.svc.cluster.local:6379` in a pod; the bed has no cluster
  DNS, so the head's IP is substituted (the only deviation from KubeRay's string);
* `authOptions.mode: token`: the operator creates a Secret with a random token and sets
  RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (secretKeyRef) in every Ray container; here every host (and the
  driver / doctor, which in a cluster run in the head pod) gets the same two variables;
* the workers' `wait-gcs-ready` init container (KubeRay injects it) is a TCP wait for the head's GCS port;
* the pod's securityContext sysctls (the ephemeral port range) are set in each host's network namespace;
* the firewall is generated from the NetworkPolicy (alpa_job.cluster.netpol): its member ports accepted
  from the 3 bed IPs, everything else refused with a TCP reset.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from alpa_job.cluster import kuberay, netpol

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "k8s" / "overlays" / "cpu-smoke"
FORM_TIMEOUT = 60
GIB = 1 << 30

_WAIT_PORT = r"""
import socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.monotonic()
while True:
    try:
        socket.create_connection((host, port), timeout=1).close()
        break
    except OSError as e:
        if time.monotonic() - t0 > timeout:
            sys.exit("%s:%d not reachable after %.0f s: %s" % (host, port, timeout, e))
        time.sleep(0.2)
"""

# Listens on the given ports of this host's IP until stdin closes (the negative firewall check).
_LISTEN = r"""
import socket, sys
socks = []
for port in map(int, sys.argv[2:]):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], port))
    s.listen(8)
    socks.append(s)
print("LISTENING", flush=True)
sys.stdin.read()
"""

_CONNECT = r"""
import json, socket, sys
out = {}
for port in map(int, sys.argv[2:]):
    try:
        socket.create_connection((sys.argv[1], port), timeout=2).close()
        out[port] = "open"
    except ConnectionRefusedError:
        out[port] = "refused"
    except OSError as e:
        out[port] = repr(e)
print("CONNECT " + json.dumps(out))
"""


def _rendered():
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed: cannot render the cpu-smoke overlay")
    text = subprocess.run([kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True, check=True, timeout=60).stdout
    docs = [d for d in yaml.safe_load_all(text) if d]
    by_kind = {d["kind"]: d for d in docs}
    return by_kind["RayCluster"], by_kind["NetworkPolicy"]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return "(%s)" % e


def test_kuberay_command_lines_form_a_cluster_under_the_networkpolicy(testbed_factory):
    pytest.importorskip("ray")
    t_start = time.monotonic()
    raycluster, policy = _rendered()
    name = raycluster["metadata"]["name"]
    spec = raycluster["spec"]
    head_group = spec["headGroupSpec"]
    workers = spec["workerGroupSpecs"]
    assert len(workers) == 1 and workers[0]["replicas"] == 2, "the bed has 1 head + 2 worker hosts"
    worker_group = workers[0]

    bed = testbed_factory(3, tag="k8s")
    hosts = bed.hosts
    head, w1, w2 = hosts
    members = [h.ip for h in hosts]
    logs = bed.state_dir / "k8s-logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        # ---- the commands KubeRay would run, per pod ------------------------------------------------
        pods = [(head, head_group, "head")] + [(h, worker_group, "worker") for h in (w1, w2)]
        commands, argvs = {}, {}
        for h, group, role in pods:
            # head_address: the head's IP where a pod has the head Service's FQDN (no cluster DNS here).
            commands[h.name] = kuberay.container_args(
                group,
                role,
                name,
                pod_ip=h.ip,
                head_address=None if role == "head" else head.ip,
                head_port=head_group["rayStartParams"].get("port", kuberay.DEFAULT_GCS_PORT),
            )
            argvs[h.name] = kuberay.ray_start_argv(
                group, role, name, pod_ip=h.ip, head_address=None if role == "head" else head.ip, head_group=head_group
            )
            assert commands[h.name].startswith(kuberay.ULIMIT_PREFIX)
            assert shlex.split(commands[h.name][len(kuberay.ULIMIT_PREFIX) :]) == argvs[h.name]
        # The exact lines (cpu-smoke: 1 CPU / 2Gi per pod; the operator's additions marked).
        common = [
            "--dashboard-agent-grpc-port=8078",
            "--dashboard-agent-listen-port=52365",  # KubeRay
            "--max-worker-port=19999",
            "--memory=%d" % (2 * GIB),  # KubeRay, from limits.memory
            "--metrics-export-port=8080",  # KubeRay
            "--min-worker-port=10002",
            "--node-ip-address=%s",
            "--node-manager-port=8076",
            "--num-cpus=1",  # KubeRay, from limits.cpu
            "--object-manager-port=8077",
            "--object-store-memory=536870912",
        ]  # the overlay's (KubeRay adds none)

        def expected(role, ip):
            flags = [f % ip if "%s" in f else f for f in common] + ["--runtime-env-agent-port=8079", "--block"]
            if role == "head":
                flags += ["--dashboard-host=0.0.0.0", "--dashboard-port=8265", "--port=6379", "--ray-client-server-port=10001"]
            else:
                flags += ["--address=%s:6379" % head.ip]
            return ["ray", "start"] + (["--head"] if role == "head" else []) + sorted(flags)

        for h, _, role in pods:
            assert argvs[h.name][:2] == ["ray", "start"]
            assert sorted(argvs[h.name]) == sorted(expected(role, h.ip)), argvs[h.name]

        # ---- the pods' environment: container env + what the operator injects for token auth ---------
        assert (spec.get("authOptions") or {}).get("mode") == "token"
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
        envs = {}
        for h, group, _ in pods:
            env = kuberay.container_env(group, pod_ip=h.ip)
            assert env["MY_POD_IP"] == h.ip and env["XLA_SERVER_PORT_END"] == "25000"
            env.update(auth)
            envs[h.name] = env

        # ---- firewall from the NetworkPolicy, sysctls from the pod spec ------------------------------
        spec_path = bed.state_dir / "k8s-cluster-spec.yaml"
        spec_path.write_text("cluster_cidr: %s\n" % bed.subnet)
        from alpa_job.cluster.spec import load_spec

        cspec = load_spec(str(spec_path))
        for h, group, _ in pods:
            nft = bed.state_dir / ("k8s-nftables-%s.nft" % h.name)
            nft.write_text(netpol.render_policy_nftables(policy, cspec, h.ip, members))
            bed.exec(h.name, "nft", "-f", str(nft), timeout=30)
            for sysctl in group["template"]["spec"].get("securityContext", {}).get("sysctls", []):
                bed.exec(h.name, "sysctl", "-q", "-w", "%s=%s" % (sysctl["name"], sysctl["value"]), timeout=30)

        # ---- negative check first (no Ray yet: cheap): the firewall is the policy's, not the spec's ---
        # 22 (ssh) is open between members in the bare-metal plan but not in the policy; 9000 is in neither;
        # 8265 is in the policy: a listener on all three on w1, connects from the head.
        probe_ports = ["22", "9000", "8265"]
        listener = bed.popen("w1", "python", "-c", _LISTEN, w1.ip, *probe_ports, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout.readline().strip() == "LISTENING"
            p = bed.exec("head", "python", "-c", _CONNECT, w1.ip, *probe_ports, timeout=30)
        finally:
            listener.stdin.close()
            listener.wait(timeout=10)
        connect = json.loads([x for x in p.stdout.splitlines() if x.startswith("CONNECT ")][0][8:])
        assert connect == {"22": "refused", "9000": "refused", "8265": "open"}, connect
        refused = bed.exec("w1", "nft", "list", "set", "inet", "alpa_kit", "rejected_tcp_from").stdout
        assert "%s . 22" % head.ip in refused and "%s . 9000" % head.ip in refused, refused

        # ---- start: head, then (after its GCS answers, like wait-gcs-ready) the workers ---------------
        def start(h):
            log = open(logs / ("%s.log" % h.name), "wb")
            try:
                procs.append(
                    bed.popen(h.name, "/bin/bash", "-c", "--", commands[h.name], env=envs[h.name], stdout=log, stderr=subprocess.STDOUT)
                )
            finally:
                log.close()

        start(head)
        p = bed.exec("w1", "python", "-c", _WAIT_PORT, head.ip, "6379", str(FORM_TIMEOUT), timeout=FORM_TIMEOUT + 10, check=False)
        assert p.returncode == 0, (p.stderr, _tail(logs / "head.log"))
        start(w1)
        start(w2)

        address = "%s:6379" % head.ip
        driver_env = dict(auth, RAY_ADDRESS=address)
        p = bed.exec(
            "head",
            "python",
            "-m",
            "alpa_job.cluster.wait_nodes",
            "--count",
            "3",
            "--timeout",
            str(FORM_TIMEOUT),
            env=driver_env,
            timeout=FORM_TIMEOUT + 30,
            check=False,
        )
        assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
        nodes = json.loads([x for x in p.stdout.splitlines() if x.startswith("{")][-1])["resources"]
        for pr in procs:
            assert pr.poll() is None, "a `ray start --block` exited: %s" % {h.name: _tail(logs / ("%s.log" % h.name)) for h in hosts}
        assert sorted(nodes) == sorted(members), (nodes, {h.name: _tail(logs / ("%s.log" % h.name)) for h in hosts})
        for ip, res in nodes.items():  # the limits made it into Ray: 1 CPU, 2Gi of task memory per pod
            assert res["CPU"] == 1 and res["memory"] == 2 * GIB, (ip, res)
            assert res["object_store_memory"] == 536870912, (ip, res)  # the overlay's object-store-memory

        # ---- doctor, from the head "pod" (its env has the token, as in a pod) -------------------------
        # --skip-ports ssh: the bare-metal plan opens ssh between members, pods have no sshd and the policy
        # does not open 22 (checked refused above); every other planned port and range is probed.
        t0 = time.monotonic()
        p = bed.exec(
            "head",
            "python",
            "-m",
            "alpa_job",
            "doctor",
            "--address",
            address,
            "--cluster-spec",
            str(spec_path),
            "--format",
            "json",
            "--skip-ports",
            "ssh",
            env=auth,
            timeout=120,
            check=False,
        )
        doctor_s = time.monotonic() - t0
        data = json.loads(p.stdout) if p.stdout.strip().startswith("{") else None
        failed = [c for c in (data or {}).get("checks", []) if not c["ok"]]
        assert p.returncode == 0 and data and data["ok"] is True, (failed or p.stdout[-3000:], p.stderr[-2000:])
        assert sorted(data["nodes"]) == sorted(members) and data["skipped_ports"] == ["ssh"]
        for ip, ports in data["probed_ports"].items():
            names = {x.split()[1] for x in ports}
            assert {"node_manager", "object_manager", "xla_grpc", "ephemeral", "ray_workers"} <= names, ip
            assert "ssh" not in names and ("gcs" in names) == (ip == head.ip), (ip, names)
        for src in members:
            for dst in members:
                if src != dst:
                    assert data["matrix"][src][dst]["ok"] is True, (src, dst, data["matrix"][src][dst])
        print("kuberay test bed: doctor %.1f s, total %.1f s" % (doctor_s, time.monotonic() - t_start))
    finally:
        # Killing each host's PID 1 takes every Ray process (and the --block foreground ones) with it.
        bed.down()
        for pr in procs:
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait(timeout=10)
