"""What runs ON each node for `doctor --network`: its side of the link probe between two nodes.

A node's `LinkReceiver` listens on a port of the cluster's ephemeral range (the range NCCL and gloo bind
in, which the firewall opens between members, so the probe takes the path training traffic takes). A
sender first bounces small messages off it (latency: the median round trip), then streams bytes for a
fixed time; the receiver times the stream from its first byte to its last (a sender's clock would
count the bytes still sitting in its socket buffer as sent).

Imports on the Alpa image's stack (Python 3.9, ray 2.1.0): standard library only.
"""

from __future__ import annotations

import random
import socket
import statistics
import threading
import time
from typing import Any, Dict, Optional, Tuple

PINGS = 20  # round trips for the latency figure
PING, BULK = b"p", b"B"  # the sender's marks: a ping to echo, then the bulk stream until EOF
CHUNK = 1 << 18
IO_TIMEOUT_S = 10.0  # no socket operation of the probe waits longer


def bind_in_range(ip: str, lo: int, hi: int, tries: int = 64) -> socket.socket:
    """A listening socket on `ip` at a free port in [lo, hi]: the kernel's choice when it falls inside (nodes
    pin their ephemeral range to it), else the first free one of a random sample."""
    for port in [0] + random.sample(range(lo, hi + 1), min(tries, hi - lo + 1)):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError:
            sock.close()
            continue
        if lo <= sock.getsockname()[1] <= hi:
            sock.listen(8)
            return sock
        sock.close()
    raise OSError("no free port in %d-%d on %s" % (lo, hi, ip))


class LinkReceiver:
    """Accepts senders on one port until closed; each peer's last stream: bytes, seconds, when."""

    def __init__(self, ip: str, port_range: Tuple[int, int], hold_s: float):
        self.sock = bind_in_range(ip, *port_range)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.streams: Dict[str, Dict[str, Any]] = {}
        self._stop = threading.Event()
        self._until = time.monotonic() + hold_s
        threading.Thread(target=self._accept, name="doctor-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._until:
            try:
                conn, (peer, _) = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            threading.Thread(target=self._serve, args=(conn, peer), name="doctor-link-serve", daemon=True).start()
        self.sock.close()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        received, first, last = 0, None, None
        try:
            while True:
                mark = conn.recv(1)
                if mark == PING:
                    conn.sendall(PING)
                    continue
                break  # BULK, or EOF
            while True:
                data = conn.recv(CHUNK)
                if not data:
                    break
                now = time.monotonic()
                first = now if first is None else first
                last = now
                received += len(data)
        except OSError as err:
            self.streams[peer] = {"error": "%s" % (err.strerror or err)}
            conn.close()
            return
        seconds = (last - first) if first is not None and last is not None else 0.0
        # Recorded before the close: the sender returns at the close, and the driver asks right after.
        self.streams[peer] = {"bytes": received, "seconds": round(seconds, 4)}
        conn.close()

    def take(self, peer: str) -> Optional[Dict[str, Any]]:
        return self.streams.pop(peer, None)

    def close(self) -> None:
        self._stop.set()


def route_to(dst: str) -> Dict[str, Any]:
    """The address (and its interface) this host's kernel sends from toward `dst`: a UDP socket's connect
    chooses the route without sending anything."""
    from alpa_job.cluster.node_ip import local_ipv4_addresses

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect((dst, 9))
        source = sock.getsockname()[0]
    except OSError as err:
        return {"source": None, "iface": None, "error": "%s" % (err.strerror or err)}
    finally:
        sock.close()
    iface = next((name for name, ips in local_ipv4_addresses().items() if source in ips), None)
    return {"source": source, "iface": iface, "error": None}


def send_stream(src: str, dst: str, port: int, seconds: float, connect_timeout_s: float) -> Dict[str, Any]:
    """From this node's address `src` (the receiver knows the sender by it), ping `dst` PINGS times, then
    stream to it for `seconds`: {rtt_ms, sent_bytes} or {error}."""
    payload = b"\0" * CHUNK
    try:
        conn = socket.create_connection((dst, port), timeout=connect_timeout_s, source_address=(src, 0))
    except OSError as err:
        return {"error": "connect %s:%d: %s" % (dst, port, err.strerror or err)}
    conn.settimeout(IO_TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    sent = 0
    try:
        for _ in range(PINGS):
            t = time.monotonic()
            conn.sendall(PING)
            if conn.recv(1) != PING:
                return {"error": "%s:%d did not echo the probe" % (dst, port)}
            rtts.append(time.monotonic() - t)
        conn.sendall(BULK)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)
            sent += len(payload)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # EOF once the receiver has read everything: the stream is timed by then
    except OSError as err:
        return {"error": "stream to %s:%d: %s" % (dst, port, err.strerror or err), "sent_bytes": sent}
    finally:
        conn.close()
    return {"rtt_ms": round(statistics.median(rtts) * 1e3, 3), "sent_bytes": sent}
