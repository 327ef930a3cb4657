"""Which start-up calls hold Python's GIL (and so cannot overlap other Python work on another thread):
a thread counts loop iterations while the main thread makes each call; the rate during the call over
the idle rate is the share of the call the other thread could run.

    python3 bench/gil_probe.py [STEP.xla]   # STEP.xla: a stored step (compile cache's alpa_job-steps/)

Also times the first buffer put on a device against the second (the allocator's pool is reserved then).
"""

from __future__ import annotations

import json
import sys
import threading
import time

count = [0]
stop = threading.Event()


def spin() -> None:
    while not stop.is_set():
        count[0] += 1


def timed(name: str, call, idle_rate: float) -> dict:
    c0, t0 = count[0], time.perf_counter()
    call()
    c1, t1 = count[0], time.perf_counter()
    rate = (c1 - c0) / (t1 - t0)
    return {"call": name, "seconds": round(t1 - t0, 3), "other_thread_share": round(rate / idle_rate, 2)}


def load_step(path: str, idle: float) -> list:
    """The stored step's two halves as jax's deserialize_and_load runs them: unpickling (the executable
    deserialised) and loading it onto the devices."""
    import io

    import jax
    from jax.experimental import serialize_executable

    with open(path, "rb") as f:
        payload = f.read()
    backend = jax.devices()[0].client
    out = {}

    def unpickle():
        out["unloaded"] = serialize_executable._JaxPjrtUnpickler(io.BytesIO(payload), backend).load()[0]

    rows = [timed(f"unpickle stored step ({len(payload) >> 10} KiB)", unpickle, idle)]
    rows.append(timed("load it onto the device", lambda: out.update(loaded=out["unloaded"].load()), idle))
    rows.append(timed("its HLO as text", lambda: [m.to_string() for m in out["loaded"].xla_extension_executable().hlo_modules()], idle))
    rows.append(timed("unpickle + load again", lambda: (unpickle(), out["unloaded"].load()), idle))
    return rows


def main() -> None:
    import jax  # before the counting thread: an import beside a busy thread takes many times as long
    import numpy as np

    threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.05)
    c0, t0 = count[0], time.perf_counter()
    time.sleep(0.3)
    idle = (count[0] - c0) / (time.perf_counter() - t0)
    rows = [timed("jax.devices()", jax.devices, idle)]
    one = np.zeros((), np.int32)
    rows.append(timed("first device_put + wait", lambda: jax.device_put(one).block_until_ready(), idle))
    rows.append(timed("second device_put + wait", lambda: jax.device_put(one).block_until_ready(), idle))
    if len(sys.argv) > 1:
        rows += load_step(sys.argv[1], idle)
    x = jax.numpy.ones((4096, 4096))
    rows.append(timed("first matmul + sync", lambda: (x @ x).block_until_ready(), idle))
    stop.set()
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
