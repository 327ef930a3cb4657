"""A node reached over SSH with fabric (the inventory's address, user, port and key), or locally for
`ansible_connection: local`: run a command with a time limit, fetch a file. Nothing here waits unbounded:
the TCP connect, the SSH banner and authentication and every command have their own timeouts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import NamedTuple, Optional

from alpa_job.cluster.control.inventory import Node

CONNECT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 20.0


class Result(NamedTuple):
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def why(self) -> str:
        """The last line of stderr (else stdout): what went wrong, on one line."""
        text = (self.stderr or self.stdout or "").strip().splitlines()
        return text[-1][:300] if text else "exit %d" % self.rc


class RemoteError(Exception):
    """The node could not be reached or a command on it did not finish: the message says which."""


class Remote:
    """`with Remote(node) as r: r.run("cmd")`. Connects on first use; `.client` is paramiko's SSHClient."""

    def __init__(self, node: Node, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.node = node
        self.connect_timeout_s = connect_timeout_s
        self.conn = None

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        n = self.node
        return "local" if n.local else "%s@%s:%d" % (n.user or os.environ.get("USER", "root"), n.address, n.port)

    def connect(self) -> None:
        if self.node.local or self.conn is not None:
            return
        try:
            import fabric
        except ImportError:
            raise RemoteError("fabric is not installed on the controller: pip install -r requirements/dev.txt") from None
        n = self.node
        kwargs = {"banner_timeout": self.connect_timeout_s, "auth_timeout": self.connect_timeout_s, "allow_agent": True}
        if n.key_file:
            kwargs["key_filename"] = os.path.expanduser(str(n.key_file))
        if n.password:
            kwargs["password"] = str(n.password)
        conn = fabric.Connection(n.address, user=n.user or None, port=n.port, connect_timeout=self.connect_timeout_s, connect_kwargs=kwargs)
        try:
            conn.open()
        except Exception as err:  # socket.timeout, NoValidConnectionsError, AuthenticationException, ...
            conn.close()
            raise RemoteError("cannot SSH to %s (%s)" % (self.describe(), _one_line(err))) from None
        self.conn = conn

    @property
    def client(self):
        self.connect()
        return None if self.conn is None else self.conn.client

    def run(self, command: str, timeout_s: float = COMMAND_TIMEOUT_S) -> Result:
        """Run a shell command; a command past `timeout_s` raises RemoteError (its channel is closed)."""
        t0 = time.monotonic()
        if self.node.local:
            try:
                p = subprocess.run(
                    ["sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=timeout_s
                )
            except subprocess.TimeoutExpired:
                raise RemoteError("`%s` did not finish within %.0f s on %s" % (_short(command), timeout_s, self.node.name)) from None
            return Result(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)
        self.connect()
        try:
            r = self.conn.run(command, hide=True, warn=True, timeout=timeout_s, in_stream=False)
        except Exception as err:  # invoke's CommandTimedOut, a dropped connection
            raise RemoteError("`%s` on %s: %s" % (_short(command), self.node.name, _one_line(err))) from None
        return Result(r.exited, r.stdout, r.stderr, time.monotonic() - t0)

    def get(self, remote_path: str, local_path: str) -> None:
        """Copy one file from the node (SFTP)."""
        if self.node.local:
            shutil.copyfile(remote_path, local_path)
            return
        self.connect()
        try:
            self.conn.get(remote_path, local=local_path)
        except Exception as err:
            raise RemoteError("cannot copy %s from %s (%s)" % (remote_path, self.node.name, _one_line(err))) from None

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:300]


def _short(command: str) -> str:
    return command if len(command) <= 60 else command[:57] + "..."


def remote_for(node: Node, connect_timeout_s: Optional[float] = None) -> Remote:
    return Remote(node, connect_timeout_s or CONNECT_TIMEOUT_S)
