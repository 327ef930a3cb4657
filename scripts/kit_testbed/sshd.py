"""sshd inside test-bed hosts, so Ansible reaches them over real SSH (the ``ssh_bed`` fixture, the Ansible
tests, bench/ansible_site.py).

``SshBed(bed)``: a throw-away key pair and host key under ``<state>/ssh``, and ``/usr/sbin/sshd -D``
running inside each host (``start``), listening on that host's IP port 22, root login by key only.
``.testbed``, ``.key`` (client private key), ``.ssh_dir``, ``.ssh(host_or_ip, *cmd)`` (runs ssh from the
head), ``.stop()``.

On a site bed (``Testbed.up(..., site=True)``, see ``site_bed``): sshd runs in the NODE hosts only and
the client side is the CONTROLLER (``ctl``, outside the cluster CIDR): ``.ssh(host, *cmd)`` runs ssh from
the controller, and ``.ssh_config`` (written by ``start``) names every node (``Host head`` -> its IP,
``User root``, ``IdentityFile`` = ``.key``, no host-key prompts) for ``ssh -F <ssh_config> w1 ...`` or
Ansible's ``ansible_ssh_common_args``.

The hosts share the machine's filesystem (not /tmp/ray, /dev/shm, /etc/hosts), so one key pair and
one authorized_keys serve all of them; each sshd has its own config and pid file.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import List

SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
SSH_OPTS = [
    "-o",
    "StrictHostKeyChecking=no",
    "-o",
    "UserKnownHostsFile=/dev/null",
    "-o",
    "BatchMode=yes",
    "-o",
    "LogLevel=ERROR",
    "-o",
    "ConnectTimeout=5",
]


class SshBed:
    def __init__(self, bed):
        self.testbed = bed
        self.ssh_dir = bed.state_dir / "ssh"
        self.key = self.ssh_dir / "id_ed25519"
        self.ssh_config = self.ssh_dir / "ssh_config"
        # Where the client runs: the site's controller when there is one (its SSH comes from outside
        # the cluster CIDR, like a laptop or bastion), else the head.
        self.client = bed.controller.name if getattr(bed, "controller", None) else "head"
        self._procs: List[subprocess.Popen] = []

    def _write_keys(self):
        self.ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (self.key, self.ssh_dir / "host_ed25519"):
            if not path.exists():
                subprocess.run(
                    ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "akt-testbed", "-f", str(path)], check=True, timeout=30
                )
        auth = self.ssh_dir / "authorized_keys"
        auth.write_text(Path(str(self.key) + ".pub").read_text())
        auth.chmod(0o600)
        blocks = []
        for h in self.testbed.hosts:
            blocks.append(
                "\n".join(
                    [
                        f"Host {h.name} {h.ip}",
                        f"  HostName {h.ip}",
                        "  User root",
                        f"  Port {SSH_PORT}",
                        f"  IdentityFile {self.key}",
                        "  IdentitiesOnly yes",
                        "  StrictHostKeyChecking no",
                        "  UserKnownHostsFile /dev/null",
                        "  LogLevel ERROR",
                        "  BatchMode yes",
                        "  ConnectTimeout 5",
                    ]
                )
            )
        self.ssh_config.write_text("\n".join(blocks) + "\n")

    def _config(self, host) -> Path:
        conf = self.ssh_dir / f"sshd_{host.name}.conf"
        conf.write_text(
            "\n".join(
                [
                    f"ListenAddress {host.ip}",
                    f"Port {SSH_PORT}",
                    f"HostKey {self.ssh_dir / 'host_ed25519'}",
                    f"AuthorizedKeysFile {self.ssh_dir / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "UseDNS no",
                    "MaxStartups 100",
                    "MaxSessions 100",
                    f"PidFile {self.ssh_dir / f'sshd_{host.name}.pid'}",
                    "Subsystem sftp internal-sftp",
                    "",
                ]
            )
        )
        return conf

    def start(self, timeout: float = 20):
        self._write_keys()
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation dir (shared, harmless)
        for h in self.testbed.hosts:
            conf = self._config(h)
            log = open(self.ssh_dir / f"sshd_{h.name}.log", "ab")
            self._procs.append(self.testbed.popen(h.name, SSHD, "-D", "-e", "-f", str(conf), stdout=log, stderr=subprocess.STDOUT))
            log.close()
        deadline = time.monotonic() + timeout
        for h in self.testbed.hosts:
            code = (
                "import socket,sys,time\n"
                "d=time.monotonic()+%f\n"
                "while True:\n"
                "    try:\n"
                "        socket.create_connection((%r,%d),1).close(); break\n"
                "    except OSError:\n"
                "        if time.monotonic()>d: sys.exit('sshd on %s not listening')\n"
                "        time.sleep(0.1)\n"
            ) % (max(1.0, deadline - time.monotonic()), h.ip, SSH_PORT, h.ip)
            self.testbed.exec(h.name, "python", "-c", code, timeout=timeout + 10)

    def ssh(self, target: str, *cmd, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        ip = self.testbed.host(target).ip
        return self.testbed.exec(self.client, "ssh", *SSH_OPTS, "-i", str(self.key), f"root@{ip}", *cmd, timeout=timeout, check=check)

    def stop(self):
        for h in self.testbed.hosts:
            pidfile = self.ssh_dir / f"sshd_{h.name}.pid"
            if pidfile.exists():  # the PID is the host's own (its PID namespace): kill it from inside
                self.testbed.exec(h.name, "kill", pidfile.read_text().strip(), check=False, timeout=10)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self._procs.clear()
