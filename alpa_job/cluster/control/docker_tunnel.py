"""A node's Docker API for the docker SDK on the controller, forwarded over the node's SSH connection.

Docker's own `ssh://` transport needs the docker CLI on the node and always talks to its default socket;
the kit's `alpa_kit_docker_host` may name another one. So the tunnel is ours:

- `unix:///path` on the node: a local Unix socket (in a private temp dir) whose every connection opens
  an SSH exec channel running a small byte relay to that socket in the node's Python (Ansible needs
  one there anyway); `ssh -L local.sock:remote.sock` does the same, but paramiko cannot open
  OpenSSH's streamlocal channels;
- `tcp://host:port` as the node sees it: an SSH `direct-tcpip` channel per connection;
- a node with `ansible_connection: local`: the docker SDK straight against its docker host.

Every client gets a request timeout; the tunnel's threads are daemons and close with the context.
"""

from __future__ import annotations

import base64
import os
import select
import shlex
import socket
import tempfile
import threading
from typing import List, Optional

from alpa_job.cluster.control.remote import Remote

REQUEST_TIMEOUT_S = 15.0

_RELAY = r"""
import os, socket, sys, threading
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
def up():
    while True:
        b = os.read(0, 65536)
        if not b:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(b)
threading.Thread(target=up, daemon=True).start()
while True:
    b = s.recv(65536)
    if not b:
        break
    while b:
        b = b[os.write(1, b):]
"""


class DockerTunnel:
    """`with DockerTunnel(remote, "unix:///var/run/docker.sock") as t: t.client().ping()`."""

    def __init__(self, remote: Remote, docker_host: str, timeout_s: float = REQUEST_TIMEOUT_S):
        self.remote = remote
        self.docker_host = docker_host
        self.timeout_s = timeout_s
        self.errors: List[str] = []  # what the relays said on stderr (a missing socket, a refused connect)
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self._server: Optional[socket.socket] = None
        self._closed = threading.Event()

    def __enter__(self) -> "DockerTunnel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def base_url(self) -> str:
        """What the docker SDK connects to: the node's own docker host when local, else our socket."""
        if self.remote.node.local:
            return self.docker_host
        if self._server is None:
            self._start()
        return "unix://" + self._server.getsockname()

    def client(self):
        import docker

        return docker.DockerClient(base_url=self.base_url(), timeout=self.timeout_s)

    def _start(self) -> None:
        scheme, _, where = self.docker_host.partition("://")
        if scheme not in ("unix", "tcp"):
            raise ValueError("alpa_kit_docker_host %r: only unix:// and tcp:// can be forwarded over SSH" % self.docker_host)
        self.remote.connect()
        self._dir = tempfile.TemporaryDirectory(prefix="akt-docker-")
        os.chmod(self._dir.name, 0o700)  # the forwarded engine is root on the node: only us
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(os.path.join(self._dir.name, "docker.sock"))
        server.listen(16)
        server.settimeout(0.5)
        self._server = server
        threading.Thread(target=self._accept, args=(scheme, where), name="docker-tunnel", daemon=True).start()

    def _open_channel(self, scheme: str, where: str):
        transport = self.remote.client.get_transport()
        if scheme == "tcp":
            host, _, port = where.rstrip("/").rpartition(":")
            return transport.open_channel(
                "direct-tcpip", (host or "127.0.0.1", int(port or 2375)), ("127.0.0.1", 0), timeout=self.timeout_s
            )
        chan = transport.open_session(timeout=self.timeout_s)
        code = base64.b64encode(_RELAY.encode()).decode()
        chan.exec_command(
            "%s -c %s %s"
            % (
                shlex.quote(self.remote.node.python),
                shlex.quote("import base64;exec(base64.b64decode('%s'))" % code),
                shlex.quote("/" + where.lstrip("/")),
            )
        )
        return chan

    def _accept(self, scheme: str, where: str) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                chan = self._open_channel(scheme, where)
            except Exception as err:
                self.errors.append("cannot open an SSH channel to %s: %s" % (self.docker_host, err))
                conn.close()
                continue
            threading.Thread(target=self._pump, args=(conn, chan), name="docker-pump", daemon=True).start()

    def _pump(self, conn: socket.socket, chan) -> None:
        try:
            local_open = True
            while not self._closed.is_set():
                ready, _, _ = select.select([conn, chan] if local_open else [chan], [], [], 0.5)
                if conn in ready:
                    data = conn.recv(65536)
                    if data:
                        chan.sendall(data)
                    else:
                        chan.shutdown_write()
                        local_open = False
                if chan in ready or chan.recv_ready():
                    data = chan.recv(65536)
                    if not data:
                        break
                    conn.sendall(data)
                if chan.recv_stderr_ready():
                    text = chan.recv_stderr(4096).decode(errors="replace").strip().splitlines()
                    if text:
                        self.errors.append(text[-1][:300])
        except OSError:
            pass
        finally:
            try:
                while chan.recv_stderr_ready():
                    text = chan.recv_stderr(4096).decode(errors="replace").strip().splitlines()
                    if text:
                        self.errors.append(text[-1][:300])
            except Exception:
                pass
            chan.close()
            conn.close()

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
