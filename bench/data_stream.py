"""The streaming input pipeline (`--dataset tokens`) on a >= 2 GB token file: start-up, memory, shares.

Modes:

  first-batch  a fresh Python process per run: the pre-Ray input check (`alpa_job.data.checks.check_input`),
               then `open_source` + `InputStream(...).batches(0)`'s first element. Seconds from the
               parent's `Popen` to the first batch (interpreter start and imports included), each phase,
               and the child's RSS (VmRSS, VmHWM). Runs with the file in the page cache ("warm") and
               after dropping this one file's pages (posix_fadvise DONTNEED: "cold").
  stream       one fresh process reads its share (process 0 of 3) of --steps global batches (no training),
               RSS every steps/20; then the same with the page dropping (MADV_DONTNEED) switched off, as
               the control: what the kit's flat RSS is worth over a read far larger than a training run's.
  testbed      the 3-host test bed (kit_testbed.hosts + the one Ray bring-up kit_testbed.ray_layer.start_ray;
               head + 2 workers, each one JAX process of --devices CPU devices): `python -m alpa_job train
               --address HEAD:6379 --preset gpt-small --dataset tokens --data-path FILE` from the head. A
               sampler reads VmRSS of every host's JAX process (`ray::JaxProcess*` in that host's PID
               namespace) every 0.25 s from outside (VmRSS, RssAnon, RssFile); over the samples after the driver
               printed step 1 (`--progress-every 1`): first, last, and the growth of the per-step peak
               (peak of the last quarter - peak of the first). `--dataset synthetic` is the control.
               Bytes/rows read per process and data_wait_fraction come from the run's report.json.
  gpu          in this process (`--address none`, no Ray): `--preset gpt-24l` from a token file made on
               the spot (one GPU; the device machine). Records data_wait_fraction.

The token file is uint16, values < 1024 (a cheap repeated pattern written in 64 MiB chunks), made once
under /tmp/work/ (never in the repo) and reused when its size matches. The test-bed hosts see the
machine's /tmp (only /tmp/ray and /dev/shm are per host), so the same path reads on every host.

    .venv/bin/python bench/data_stream.py first-batch [--file F] [--gib 2] [--runs 3]
    .venv/bin/python bench/data_stream.py stream [--steps 20000]
    flock /tmp/work/testbed.lock .venv/bin/python bench/data_stream.py testbed [--steps 150] [--batch-size 48]
    python3 bench/data_stream.py gpu --out $OUT [--steps 60]

Prints a table and writes bench/results/data_stream-<mode>-<UTC time>.json (`--out` for gpu).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from lib.checkout import REPO  # first: alpa_job and the test bed's package from this checkout
from lib.results import save_run
from lib.table import print_table

DEFAULT_FILE = "/tmp/work/data_stream/tokens-2g.u16"
CHUNK_TOKENS = 32 << 20  # 64 MiB of uint16 per write
VOCAB = 1024
MB = 1e6


# ----------------------------------------------------------------------------- the token file
def make_token_file(path: str, gib: float) -> Dict[str, object]:
    """A uint16 token file of `gib` GiB (values < VOCAB); reused when it exists with that size."""
    import numpy as np

    size = int(gib * (1 << 30))
    size -= size % 2
    if os.path.isfile(path) and os.path.getsize(path) == size:
        return {"path": path, "bytes": size, "made_s": None}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, VOCAB, CHUNK_TOKENS, dtype=np.uint16)
    started = time.perf_counter()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        left = size // 2
        while left:
            n = min(left, CHUNK_TOKENS)
            f.write(pattern[:n].tobytes())
            left -= n
    os.replace(tmp, path)
    return {"path": path, "bytes": size, "made_s": round(time.perf_counter() - started, 2)}


def drop_file_cache(path: str) -> None:
    """Evict this one file's pages from the page cache (nothing else on the machine)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_fraction(path: str) -> Optional[float]:
    """Share of the file's pages in the page cache (mincore over a fresh mapping), None where unsupported."""
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        size = os.path.getsize(path)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        fd = os.open(path, os.O_RDONLY)
        try:
            base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            try:
                if libc.mincore(base, size, vec) != 0:
                    return None
            finally:
                libc.munmap(base, size)
        finally:
            os.close(fd)
        return round(sum(b & 1 for b in vec.raw) / pages, 4)
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def rss_of(pid: int) -> Dict[str, int]:
    """{VmRSS, VmHWM, RssAnon, RssFile} of `pid` in bytes ({} when gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def job_config(path: str, preset: str, batch_size: Optional[int] = None):
    from alpa_job.models import size_names
    from alpa_job.settings.config import build_config, load_settings

    cli = {"dataset": "tokens", "data_path": path, "token_dtype": "uint16", "batch_size": batch_size}
    return build_config(load_settings(preset, None, model_keys=size_names()), cli)


# ----------------------------------------------------------------------------- first-batch
def _child_first_batch(path: str, preset: str, batch_size: int, spawned: float) -> None:
    """Runs in a fresh process: the phases up to the first batch, as one JSON line."""
    t = {"python_up": time.time() - spawned}
    mark = time.perf_counter()
    from alpa_job.data.batching import plan_epoch
    from alpa_job.data.checks import check_input
    from alpa_job.data.open import open_source
    from alpa_job.data.pipeline import InputStream

    config = job_config(path, preset, batch_size)
    t["imports_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    check_input(config)
    t["check_input_s"] = time.perf_counter() - mark
    rss_after_check = rss_of(os.getpid())
    mark = time.perf_counter()
    source = open_source(config)
    epoch = plan_epoch(len(source), config.batch_size, config.remainder)
    stream = InputStream(source, epoch, config.batch_size, config.seed, 100, threads=config.data_threads, prefetch=config.prefetch)
    t["open_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    batch, real = next(stream.batches(0))
    t["first_batch_s"] = time.perf_counter() - mark
    t["total_s"] = time.time() - spawned
    rss = rss_of(os.getpid())
    print(
        "RESULT "
        + json.dumps(
            {
                "seconds": {k: round(v, 4) for k, v in t.items()},
                "rss_bytes": rss.get("VmRSS"),
                "hwm_bytes": rss.get("VmHWM"),
                "rss_after_check_bytes": rss_after_check.get("VmRSS"),
                "windows": len(source),
                "tokens": source.tokens,
                "batch_shape": list(batch["tokens"].shape),
                "real_rows": real,
                "pipeline": stream.pipeline,
                "rows_read": source.rows_read,
                "bytes_read": source.bytes_read,
            }
        ),
        flush=True,
    )
    os._exit(0)  # the prefetch threads need not wind down


def first_batch(args) -> Dict[str, object]:
    made = make_token_file(args.file, args.gib)
    runs = []
    for cache in ("cold", "warm"):
        for i in range(args.runs):
            if cache == "cold":
                drop_file_cache(args.file)
            before = cached_fraction(args.file)
            spawned = time.time()
            p = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "_child-first-batch",
                    args.file,
                    args.preset,
                    str(args.batch_size),
                    repr(spawned),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=str(REPO),
                timeout=300,
            )
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"child failed (rc {p.returncode}): {p.stderr[-3000:]}")
            row = json.loads(line[-1][len("RESULT ") :])
            row.update(cache=cache, run=i, cached_before=before)
            runs.append(row)
    header = ["cache", "run", "in cache", "python up", "imports", "check_input", "open", "1st batch", "total s", "RSS MB", "HWM MB"]
    rows = [
        [
            r["cache"],
            r["run"],
            r["cached_before"],
            *("%.3f" % r["seconds"][k] for k in ("python_up", "imports_s", "check_input_s", "open_s", "first_batch_s", "total_s")),
            "%.0f" % (r["rss_bytes"] / MB),
            "%.0f" % (r["hwm_bytes"] / MB),
        ]
        for r in runs
    ]
    table = print_table(header, rows)
    worst = max(r["seconds"]["total_s"] for r in runs)
    return {
        "file": made,
        "preset": args.preset,
        "batch_size": args.batch_size,
        "runs": runs,
        "worst_total_s": round(worst, 3),
        "target_s": 2.0,
        "met": worst <= 2.0,
        "table": table,
    }


def mb(v) -> str:
    return "-" if v is None else "%.1f" % (v / MB)


def rss_summary(rss: List[int]) -> Dict[str, int]:
    """RSS samples of one process over the training loop -> start, end, and the growth of the upper
    envelope: the peak of the last quarter of the samples minus the peak of the first quarter (a step's
    buffers come and go, so single samples swing by hundreds of MB within a step; peaks do not)."""
    if not rss:
        return {}
    q = max(len(rss) // 4, 1)
    first, last = max(rss[:q]), max(rss[-q:])
    return {
        "rss_start": rss[0],
        "rss_end": rss[-1],
        "rss_min": min(rss),
        "rss_max": max(rss),
        "peak_first_quarter": first,
        "peak_last_quarter": last,
        "growth": last - first,
        "max_over_start": max(rss) - rss[0],
    }


# ----------------------------------------------------------------------------- stream
def _child_stream(path: str, preset: str, batch_size: int, steps: int, every: int, shard: int, count: int, keep_pages: bool) -> None:
    """Runs in a fresh process: this process's share of `steps` global batches, RSS every `every` steps."""
    import alpa_job.data.tokens as tokens
    from alpa_job.data.batching import plan_epoch
    from alpa_job.data.open import open_source
    from alpa_job.data.pipeline import InputStream, Shard

    if keep_pages:  # the control: the same reads without dropping the pages after each batch
        tokens._drop_pages = lambda mapped, offset, length: None
    config = job_config(path, preset, batch_size)
    source = open_source(config)
    epoch = plan_epoch(len(source), config.batch_size, config.remainder)
    stream = InputStream(
        source, epoch, config.batch_size, config.seed, steps, Shard(shard, count), threads=config.data_threads, prefetch=config.prefetch
    )
    samples = []
    started = time.perf_counter()
    for step, _ in enumerate(stream.batches(0)):
        if step % every == 0 or step == steps - 1:
            samples.append([step, round(time.perf_counter() - started, 2), rss_of(os.getpid())])
    print(
        "RESULT "
        + json.dumps(
            {
                "samples": samples,
                "seconds": round(time.perf_counter() - started, 2),
                "rows_read": source.rows_read,
                "bytes_read": source.bytes_read,
                "wait_s": round(stream.wait_s, 3),
            }
        ),
        flush=True,
    )
    os._exit(0)


def stream(args) -> Dict[str, object]:
    """One process streams its share (process 0 of 3) of many global batches, with the kit's page
    dropping and, as the control, without it: RSS growth over a read far larger than a short training run."""
    made = make_token_file(args.file, args.gib)
    runs = []
    for keep in (False, True):
        p = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "_child-stream",
                args.file,
                args.preset,
                str(args.batch_size),
                str(args.steps),
                str(max(args.steps // 20, 1)),
                "0",
                "3",
                "1" if keep else "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(REPO),
            timeout=args.timeout,
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            raise SystemExit(f"child failed (rc {p.returncode}): {p.stderr[-3000:]}")
        r = json.loads(line[-1][len("RESULT ") :])
        first, last = r["samples"][0][2], r["samples"][-1][2]
        r.update(
            pages="kept (control)" if keep else "dropped (the kit)",
            rss_first=first.get("VmRSS"),
            rss_last=last.get("VmRSS"),
            rss_file_last=last.get("RssFile"),
            growth=last.get("VmRSS", 0) - first.get("VmRSS", 0),
            hwm=last.get("VmHWM"),
        )
        runs.append(r)
    header = [
        "pages after a batch",
        "steps",
        "rows read",
        "MB of windows",
        "s",
        "RSS first MB",
        "RSS last MB",
        "growth MB",
        "RssFile last MB",
        "HWM MB",
    ]
    table = print_table(
        header,
        [
            [
                r["pages"],
                args.steps,
                r["rows_read"],
                mb(r["bytes_read"]),
                r["seconds"],
                mb(r["rss_first"]),
                mb(r["rss_last"]),
                mb(r["growth"]),
                mb(r["rss_file_last"]),
                mb(r["hwm"]),
            ]
            for r in runs
        ],
    )
    return {
        "file": made,
        "preset": args.preset,
        "batch_size": args.batch_size,
        "shard": [0, 3],
        "steps": args.steps,
        "runs": runs,
        "met": runs[0]["growth"] <= 300 * MB,
        "table": table,
    }


# ----------------------------------------------------------------------------- testbed
STEP_RE = re.compile(r"step (\d+)/(\d+)")


def _pid_ns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class RssSampler(threading.Thread):
    """Every `interval` s: VmRSS of each host's JAX process (`ray::JaxProcess*` in the host's PID namespace)."""

    def __init__(self, hosts: Dict[str, int], interval: float = 0.25):
        super().__init__(daemon=True)
        self.ns = {_pid_ns(pid): name for name, pid in hosts.items()}
        self.interval = interval
        self.samples: List[tuple] = []  # (time, host, pid, VmRSS, RssAnon, RssFile) in bytes
        self.stop = threading.Event()

    def find(self) -> Dict[str, int]:
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            host = self.ns.get(_pid_ns(pid))
            if host and _cmdline(pid).startswith("ray::JaxProcess"):
                found[host] = pid
        return found

    def run(self) -> None:
        pids: Dict[str, int] = {}
        last_scan = 0.0
        while not self.stop.is_set():
            now = time.time()
            if len(pids) < len(self.ns) or now - last_scan > 5:
                pids.update(self.find())
                last_scan = now
            for host, pid in list(pids.items()):
                rss = rss_of(pid)
                if "VmRSS" not in rss:
                    pids.pop(host)
                else:
                    self.samples.append((now, host, pid, rss["VmRSS"], rss.get("RssAnon"), rss.get("RssFile")))
            self.stop.wait(self.interval)


def testbed(args) -> Dict[str, object]:
    from kit_testbed import hosts, ray_layer

    why = hosts.missing_requirements()
    if why:
        raise SystemExit("cannot run: " + "; ".join(why))
    made = make_token_file(args.file, args.gib)
    hosts.down(prefix=args.prefix)
    bed = hosts.Testbed.up(3, prefix=args.prefix)
    out = Path("/tmp/work/data_stream") / ("run-%s" % uuid.uuid4().hex[:8])
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        info = ray_layer.start_ray(bed, num_cpus=2, object_store_memory=200_000_000, timeout=240)
        address = info.get("address") or bed.head_address
        data = (
            ["--dataset", "tokens", "--data-path", args.file, "--token-dtype", "uint16"]
            if args.dataset == "tokens"
            else ["--dataset", args.dataset]
        )
        argv = [
            "python",
            "-m",
            "alpa_job",
            "train",
            "--address",
            address,
            "--cluster-spec",
            str(info["spec_path"]),
            "--preset",
            "gpt-small",
            *data,
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--devices",
            str(args.devices),
            "--progress-every",
            "1",
            "--out",
            str(out),
        ]
        sampler = RssSampler({h.name: h.pid for h in bed.hosts})
        sampler.start()
        steps_seen: List[tuple] = []
        log_path = out.parent / (out.name + ".log")
        load_before = os.getloadavg()[0]
        started = time.time()
        with open(log_path, "w") as log:
            p = bed.popen("head", *argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={"RAY_ADDRESS": address})
            for line in p.stdout:
                log.write(line)
                m = STEP_RE.search(line)
                if m:
                    steps_seen.append((time.time(), int(m.group(1))))
            rc = p.wait(timeout=args.timeout)
        ended = time.time()
        time.sleep(0.5)
        sampler.stop.set()
        sampler.join()
        if rc:
            raise SystemExit(f"train failed (rc {rc}); log {log_path}:\n" + log_path.read_text()[-4000:])
        report = json.loads((out / "report.json").read_text())
    finally:
        bed.down(graceful=False)
    first_step_at = next((t for t, s in steps_seen if s >= 1), None)
    procs = report.get("processes") or []
    total_bytes = sum(pr.get("bytes_read") or 0 for pr in procs)
    total_rows = sum(pr.get("rows_read") or 0 for pr in procs)
    by_ip = {pr.get("ip"): pr for pr in procs}
    host_rows = []
    for h in bed.hosts:
        after = [x for x in sampler.samples if x[1] == h.name and first_step_at is not None and x[0] >= first_step_at]
        pr = by_ip.get(h.ip, {})
        row = {
            "host": h.name,
            "ip": h.ip,
            "process": pr.get("id"),
            "samples": len(after),
            "bytes_read": pr.get("bytes_read"),
            "rows_read": pr.get("rows_read"),
        }
        row.update(rss_summary([x[3] for x in after]))
        for i, kind in ((4, "anon"), (5, "file")):  # which memory grew: the process's own, or mapped file pages
            part = rss_summary([x[i] for x in after if x[i] is not None])
            row[f"{kind}_growth"] = part.get("growth")
            row[f"{kind}_end"] = part.get("rss_end")
        row["share"] = round(pr["bytes_read"] / total_bytes, 4) if total_bytes and pr.get("bytes_read") else None
        host_rows.append(row)
    header = [
        "host",
        "proc",
        "rss 1st step MB",
        "rss end MB",
        "peak 1st quarter MB",
        "peak last quarter MB",
        "growth MB",
        "anon growth MB",
        "file growth MB",
        "bytes read",
        "rows read",
        "share of total",
    ]
    table = print_table(
        header,
        [
            [
                r["host"],
                r["process"],
                mb(r.get("rss_start")),
                mb(r.get("rss_end")),
                mb(r.get("peak_first_quarter")),
                mb(r.get("peak_last_quarter")),
                mb(r.get("growth")),
                mb(r.get("anon_growth")),
                mb(r.get("file_growth")),
                r["bytes_read"],
                r["rows_read"],
                r["share"],
            ]
            for r in host_rows
        ],
    )
    inp = report.get("input") or {}
    print("input: " + json.dumps(inp))
    growths = [r.get("growth") for r in host_rows]
    shares = [r["share"] for r in host_rows]
    return {
        "file": made,
        "command_on_head": " ".join(shlex.quote(a) for a in argv),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "devices_per_process": args.devices,
        "rc": rc,
        "wall_s": round(ended - started, 2),
        "first_step_after_s": round(first_step_at - started, 2) if first_step_at else None,
        "loop_s": round(ended - first_step_at, 2) if first_step_at else None,
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "hosts": host_rows,
        "input": inp,
        "total_bytes_read": total_bytes,
        "total_rows_read": total_rows,
        "report_summary": {k: report.get(k) for k in ("steps", "step_time_s", "samples_per_s", "summary") if k in report},
        "dataset": args.dataset,
        "rss_samples": [(round(x[0] - started, 2), x[1], x[3], x[4], x[5]) for x in sampler.samples],
        "met": {
            "rss_growth_le_300MB": all(g is not None and g <= 300 * MB for g in growths),
            "share_each_about_third": all(s is not None and abs(s - 1 / 3) < 0.01 for s in shares),
            "data_wait_le_5pct": (inp.get("data_wait_fraction") is not None and inp["data_wait_fraction"] <= 0.05),
        },
        "table": table,
    }


# ----------------------------------------------------------------------------- gpu
def gpu(args) -> Dict[str, object]:
    made = make_token_file(args.file, args.gib)
    out = Path(args.run_dir or "/tmp/data_stream_gpu_run")
    argv = [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--address",
        "none",
        "--preset",
        "gpt-24l",
        "--dataset",
        "tokens",
        "--data-path",
        args.file,
        "--token-dtype",
        "uint16",
        "--steps",
        str(args.steps),
        "--out",
        str(out),
    ] + (["--batch-size", str(args.batch_size)] if args.batch_size else [])
    started = time.time()
    p = subprocess.run(argv, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    wall = time.time() - started
    print(p.stdout[-3000:])
    if p.returncode:
        raise SystemExit(f"train failed (rc {p.returncode})")
    report = json.loads((out / "report.json").read_text())
    inp = report.get("input") or {}
    table = print_table(
        ["steps", "data_wait_fraction", "data_wait_per_step ms", "bytes_read", "wall s"],
        [
            [
                args.steps,
                inp.get("data_wait_fraction"),
                "%.3f" % (1e3 * (inp.get("data_wait_per_step_s") or 0)),
                inp.get("bytes_read"),
                "%.1f" % wall,
            ]
        ],
    )
    return {
        "file": made,
        "argv": argv,
        "wall_s": round(wall, 2),
        "input": inp,
        "report": {k: report.get(k) for k in ("steps", "step_time_s", "samples_per_s", "devices", "timing") if k in report},
        "met": {"data_wait_le_2pct": inp.get("data_wait_fraction") is not None and inp["data_wait_fraction"] <= 0.02},
        "table": table,
    }


# ----------------------------------------------------------------------------- main
def save(mode: str, result: Dict[str, object], out_dir: Optional[str] = None) -> str:
    path = save_run(f"data_stream-{mode}", result, out_dir)
    print("saved", path)
    return path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_child-first-batch":
        _child_first_batch(argv[1], argv[2], int(argv[3]), float(argv[4]))
        return 0
    if argv and argv[0] == "_child-stream":
        _child_stream(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]), int(argv[6]), int(argv[7]), argv[8] == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["first-batch", "stream", "testbed", "gpu"])
    ap.add_argument("--file", default=DEFAULT_FILE, help="the uint16 token file (made when missing)")
    ap.add_argument("--gib", type=float, default=2.0, help="its size in GiB")
    ap.add_argument("--runs", type=int, default=3, help="first-batch: runs per cache state")
    ap.add_argument("--preset", default="gpt-small", help="first-batch: the preset whose seq_len/vocab apply")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--devices", type=int, default=2, help="testbed: CPU devices per JAX process")
    ap.add_argument(
        "--dataset",
        default="tokens",
        choices=["tokens", "synthetic"],
        help="testbed: synthetic = the control without a token file (same pipeline, rows in memory)",
    )
    ap.add_argument("--prefix", default="akds", help="testbed: the bed's prefix")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    ap.add_argument("--run-dir", default=None, help="gpu: the train --out folder")
    args = ap.parse_args(argv)
    if args.mode == "first-batch":
        args.batch_size = args.batch_size or 48
        result = first_batch(args)
    elif args.mode == "stream":
        args.batch_size = args.batch_size or 48
        args.steps = args.steps or 20000
        result = stream(args)
    elif args.mode == "testbed":
        args.batch_size = args.batch_size or 48
        args.steps = args.steps or 150
        result = testbed(args)
    else:
        args.steps = args.steps or 60
        result = gpu(args)
    name = args.mode + ("-synthetic" if args.mode == "testbed" and args.dataset != "tokens" else "")
    save(name, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
