"""`python -m alpa_job cluster logs [--job ID] [--out DIR]`: every node's Ray logs in DIR/<host>/.

Per node, the best way that works:

1. while Ray is up and the node alive: Ray's log API on the head's dashboard (list the node's log
   directory, download each file; ray_http.py says why over HTTP directly);
2. otherwise (Ray down, the node dead, the dashboard unreachable, a file the API would not serve):
   over SSH with fabric, the inventory's address, user and key: the node's
   `<ray dir>/session_latest/logs` tarred there, copied, unpacked here.

`--job ID` (a submission id `raysubmit_...` or Ray's hex job id) keeps the node-wide logs (raylet,
gcs_server, dashboard, monitor, ...) and that job's driver and worker logs, and leaves other jobs'
worker logs out. Without it everything is collected. DIR/collection.json says, per node, how (api |
ssh), how many files, and what failed.

`collect_job_logs(out_dir)` is the job's side: a training job that fails calls it (Ray still up, the
driver connected) and prints where the logs went; it never raises.

Imports on the Alpa image's stack (Python 3.9): standard library and requests at module level.
"""

from __future__ import annotations

import os
import re
import shlex
import tarfile
import tempfile
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from alpa_job.errors import KitError
from alpa_job.cluster.control.ray_http import RayHttp, token_from_env
from alpa_job import strict_json

DEFAULT_DEADLINE_S = 300.0
API_TIMEOUT_S = 10.0  # each request to the head's dashboard
COLLECTION_FILE = "collection.json"
# Ray's per-worker files carry the job: worker-<worker id>-<job id hex>-<pid>.{out,err}
_WORKER_FILE = re.compile(r"^(?:.*/)?worker-[0-9a-f]+-([0-9a-f]+)-\d+\.(?:out|err)$")
# ... and python-core-driver-<job id hex><...>_<pid>.log, the driver's core log
NIL_JOB_ID = "ffffffff"
_DRIVER_FILE = re.compile(r"^(?:.*/)?python-core-driver-([0-9a-f]{8})")
_PER_WORKER = re.compile(r"^(?:.*/)?(?:worker-|python-core-worker-|python-core-driver-|runtime_env_setup-)")


class JobRef:
    """The job --job names: its Ray job id (hex) and/or submission id, as far as they are known."""

    def __init__(self, given: str, job_id: Optional[str] = None, submission_id: Optional[str] = None):
        self.given = given
        self.job_id = (job_id or "").lower() or None
        self.submission_id = submission_id

    def keeps(self, filename: str) -> bool:
        """Whether a log file belongs in this job's collection."""
        base = filename.rsplit("/", 1)[-1]
        if self.submission_id and self.submission_id in base:
            return True  # job-driver-<submission id>.log, runtime_env_setup-<...>
        worker = _WORKER_FILE.match(filename)
        if worker:
            # ffffffff: a worker Ray started before any job (prestarted on the head), which then runs
            # tasks of whichever job comes: the job's output can be there (seen on Ray 2.60)
            return worker.group(1).lower() in (self.job_id, NIL_JOB_ID)
        driver = _DRIVER_FILE.match(filename)
        if driver:
            return driver.group(1).lower() == self.job_id
        if base.startswith("job-driver-"):
            return False  # another submission's driver
        return not _PER_WORKER.match(filename)  # node-wide logs (raylet, gcs_server, dashboard...) stay


def resolve_job(api: Optional[RayHttp], given: Optional[str]) -> Optional[JobRef]:
    """--job as a JobRef: the jobs API maps a submission id to Ray's job id and back when Ray is up."""
    if not given:
        return None
    looks_hex = re.fullmatch(r"[0-9a-fA-F]{8}", given) is not None
    ref = JobRef(given, job_id=given if looks_hex else None, submission_id=None if looks_hex else given)
    if api is None:
        return ref
    try:
        for job in api.jobs():
            if given in (job.get("submission_id"), job.get("job_id")):
                return JobRef(given, job.get("job_id"), job.get("submission_id"))
    except KitError:
        pass
    return ref


# ---- way 1: Ray's log API ------------------------------------------------------------------------------
def _safe_path(root: str, name: str) -> Optional[str]:
    path = os.path.normpath(os.path.join(root, name))
    return path if path.startswith(os.path.abspath(root) + os.sep) else None


def fetch_via_api(
    api: RayHttp, node_ip: str, dest: str, job: Optional[JobRef] = None, lines: int = -1, deadline: Optional[float] = None
) -> Dict[str, Any]:
    """Download a node's log files through the log API into `dest`; {"files", "bytes", "errors"}."""
    listing = api.list_logs(node_ip)
    # the listing names sub-directories too ("events/", "old/"): files only
    names = sorted({f for files in listing.values() for f in files if not f.endswith("/")})
    if job is not None:
        names = [f for f in names if job.keeps(f)]
    os.makedirs(dest, exist_ok=True)
    done, size, errors = 0, 0, []
    for name in names:
        if deadline is not None and time.monotonic() > deadline:
            errors.append("deadline passed after %d of %d files" % (done, len(names)))
            break
        path = _safe_path(os.path.abspath(dest), name)
        if path is None:
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path, "wb") as f:
                for chunk in api.get_log(node_ip, name, lines=lines):
                    f.write(chunk)
                    size += len(chunk)
            done += 1
        except KitError as err:
            errors.append("%s: %s" % (name, err))
    return {"files": done, "bytes": size, "errors": errors, "listed": len(names)}


# ---- way 2: SSH --------------------------------------------------------------------------------------
def _remote_tar_command(log_dir: str, names: Optional[List[str]] = None) -> str:
    """A shell command that tars the node's log dir (or just `names` in it) into a temp file and prints its path."""
    listing = "." if names is None else "-T - <<'AKT_NAMES'\n%s\nAKT_NAMES" % "\n".join(names)
    return (
        'set -e; d=%s; test -d "$d" || { echo "no Ray log directory $d" >&2; exit 3; }; '
        't=$(mktemp /tmp/akt-logs.XXXXXX); cd "$d"; echo "$t"; tar -czf "$t" --ignore-failed-read %s' % (shlex.quote(log_dir), listing)
    )


def fetch_via_ssh(inv, node, dest: str, job: Optional[JobRef] = None, timeout_s: float = 120.0) -> Dict[str, Any]:
    """Tar the node's Ray logs over SSH, copy, unpack into `dest`; {"files", "bytes", "errors", "from"}."""
    from alpa_job.cluster.control.remote import Remote, RemoteError

    log_dir = inv.ray_log_dir(node)
    dest = os.path.abspath(dest)
    os.makedirs(dest, exist_ok=True)
    with Remote(node) as remote:
        try:
            names = None
            if job is not None:  # the same rule as the log API path (JobRef.keeps), applied to the node's listing
                r = remote.run("cd %s && find . -type f" % shlex.quote(log_dir), timeout_s=min(timeout_s, 30))
                if not r.ok:
                    return {"files": 0, "bytes": 0, "errors": [r.why()], "from": log_dir}
                names = [n[2:] for n in r.stdout.splitlines() if n.startswith("./") and job.keeps(n[2:])]
            r = remote.run(_remote_tar_command(log_dir, names), timeout_s=timeout_s)
            lines = r.stdout.strip().splitlines()
            if not lines or not lines[0].startswith("/tmp/akt-logs."):
                return {"files": 0, "bytes": 0, "errors": [r.why()], "from": log_dir}
            remote_tar = lines[0]  # tar's exit 1 ("file changed as we read it": Ray is writing) still made it
            with tempfile.TemporaryDirectory(prefix="akt-logs-") as tmp:
                local_tar = os.path.join(tmp, "logs.tgz")
                try:
                    remote.get(remote_tar, local_tar)
                finally:
                    remote.run("rm -f %s" % shlex.quote(remote_tar), timeout_s=20)
                size = os.path.getsize(local_tar)
                with tarfile.open(local_tar) as tar:
                    members = [m for m in tar.getmembers() if m.isfile() and _safe_path(dest, m.name)]
                    _extract(tar, members, dest)
        except RemoteError as err:
            return {"files": 0, "bytes": 0, "errors": [str(err)], "from": log_dir}
        except (tarfile.TarError, OSError) as err:
            return {"files": 0, "bytes": 0, "errors": ["the copied archive is unreadable: %s" % err], "from": log_dir}
    return {"files": len(members), "bytes": size, "errors": [], "from": log_dir}


def _extract(tar: tarfile.TarFile, members, dest: str) -> None:
    try:
        tar.extractall(dest, members=members, filter="data")  # Python >= 3.11.4 / 3.12
    except TypeError:
        tar.extractall(dest, members=members)  # members were checked by _safe_path above


# ---- the command ------------------------------------------------------------------------------------
def collect_logs(
    inv,
    out_dir: str,
    job: Optional[str] = None,
    address: Optional[str] = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    lines: int = -1,
    use_api: bool = True,
) -> Dict[str, Any]:
    """Every inventory node's logs into out_dir/<host>/ (plus any alive node the inventory lacks, by IP).
    `inv` None: Ray's alive nodes (the node list a failed job's collect_job_logs reads) into out_dir/<node IP>/;
    a Ray that does not answer is then a KitError saying to pass the inventory."""
    from alpa_job.cluster.control.status import client_token, head_url, ray_silent

    t0 = time.monotonic()
    deadline = t0 + deadline_s
    api, alive, api_error = None, {}, None
    if use_api:
        url = head_url(inv, address)
        try:
            api = RayHttp(url, token=client_token(inv), timeout_s=API_TIMEOUT_S)
            from alpa_job.cluster import ray_api

            alive = {n.ip: n for n in ray_api.alive_nodes(api.nodes())}
        except KitError as err:
            if inv is None:
                raise ray_silent(url, API_TIMEOUT_S, err, "to collect logs over SSH instead") from None
            api, api_error = None, str(err)
    os.makedirs(out_dir, exist_ok=True)
    job_ref = resolve_job(api, job)
    names = inv.by_ip() if inv is not None else {}
    targets: List[Tuple[str, Optional[str], Any]] = []  # (dir name, Ray IP or None, inventory node or None)
    for node in inv.nodes if inv is not None else []:
        ip = node.ip()
        targets.append((node.name, ip if ip in alive else None, node))
    for ip in sorted(set(alive) - set(names)):
        targets.append((ip, ip, None))
    results: Dict[str, Dict[str, Any]] = {}

    def one(name: str, ip: Optional[str], node) -> None:
        dest = os.path.join(out_dir, name)
        res: Dict[str, Any] = {"host": name, "ip": ip or (node.ip() if node else None)}
        if api is not None and ip is not None:
            try:
                got = fetch_via_api(api, ip, dest, job_ref, lines, deadline)
                if not got["errors"] or node is None:
                    res.update(got, how="api")
                    results[name] = res
                    return
                res["api_error"] = "; ".join(got["errors"])[:1000]  # then the whole directory over SSH
            except KitError as err:
                res["api_error"] = str(err)
        if node is None:
            res.update(how="none", files=0, errors=res.get("errors") or [res.get("api_error", "not in the inventory")])
        else:
            ssh = fetch_via_ssh(inv, node, dest, job_ref, timeout_s=max(5.0, deadline - time.monotonic()))
            res.update(ssh, how="ssh" if not ssh["errors"] else "failed")
        results[name] = res

    threads = [threading.Thread(target=one, args=t, name="logs-%s" % t[0], daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for name, ip, _ in targets:
        if name not in results:
            results[name] = {
                "host": name,
                "ip": ip,
                "how": "failed",
                "files": 0,
                "errors": ["no result within the %.0f s deadline" % deadline_s],
            }
    summary = {
        "out": os.path.abspath(out_dir),
        "job": job,
        "job_id": job_ref.job_id if job_ref else None,
        "submission_id": job_ref.submission_id if job_ref else None,
        "api": api.url if api else None,
        "api_error": api_error,
        "seconds": round(time.monotonic() - t0, 1),
        "hosts": [results[t[0]] for t in targets],
    }
    summary["ok"] = all(h["files"] > 0 and h["how"] in ("api", "ssh") for h in summary["hosts"])
    with open(os.path.join(out_dir, COLLECTION_FILE), "w") as f:
        strict_json.dump(summary, f, indent=2, sort_keys=True)
    return summary


def render_table(summary: Mapping[str, Any]) -> str:
    from alpa_job.cluster.doctor.render import grid

    lines = [
        "logs: %s%s in %.0f s%s"
        % (
            summary["out"],
            " (job %s)" % summary["job"] if summary["job"] else "",
            summary["seconds"],
            "" if summary["api"] else " (Ray's log API unavailable: %s)" % summary.get("api_error"),
        )
    ]
    rows = [
        (h["host"], h.get("ip") or "-", h["how"], str(h.get("files", 0)), _size(h.get("bytes")), "; ".join(h.get("errors") or [])[:120])
        for h in summary["hosts"]
    ]
    lines += [""] + grid(("host", "ip", "via", "files", "size", "problems"), rows)
    return "\n".join(lines)


def _size(n: Optional[int]) -> str:
    if not n:
        return "-"
    return "%.1f MiB" % (n / float(1 << 20)) if n >= (1 << 20) else "%d KiB" % max(1, n // 1024)


# ---- the job's side ------------------------------------------------------------------------------------
def collect_job_logs(out_dir: str, job_id: Optional[str] = None, deadline_s: float = 60.0, lines: int = 20000) -> Optional[str]:
    """For a job that failed while connected to Ray: every alive node's logs (node-wide ones and this job's)
    into out_dir/logs/<node ip>/, through Ray's log API. Returns that folder, or None when nothing could be
    collected; never raises (the job's own error is what matters). `lines`: the tail kept per file."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        ctx = ray.get_runtime_context()
        job_id = job_id or ctx.get_job_id()
        url = _dashboard_of_connected_ray()
        if not url:
            return None
        api = RayHttp(url, token=token_from_env(), timeout_s=10.0)
        from alpa_job.cluster import ray_api

        ref = JobRef(job_id, job_id=job_id, submission_id=os.environ.get("RAY_JOB_SUBMISSION_ID") or None)
        dest = os.path.join(out_dir, "logs")
        deadline = time.monotonic() + deadline_s
        got = 0
        for node in ray_api.alive_nodes(api.nodes()):
            if time.monotonic() > deadline:
                break
            got += fetch_via_api(api, node.ip, os.path.join(dest, node.ip), ref, lines, deadline)["files"]
        return dest if got else None
    except Exception:  # best effort by contract
        return None


def _dashboard_of_connected_ray() -> Optional[str]:
    """http://host:port of the connected cluster's dashboard (the GCS records where it listens)."""
    try:
        from ray._private.worker import global_worker

        url = (global_worker.node.address_info or {}).get("webui_url")
        if url:
            return url if "://" in url else "http://" + url
    except Exception:
        pass
    try:
        from ray.dashboard.utils import ray_address_to_api_server_url
        import ray

        return ray_address_to_api_server_url(ray.get_runtime_context().gcs_address)
    except Exception:
        return None
