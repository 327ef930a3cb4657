"""sshd inside test-bed hosts, so Ansible reaches them over real SSH (tests/test_ansible.py).

Fixtures (session-scoped):

* ``ssh_bed`` -> ``SshBed`` (kit_testbed.sshd): its OWN 3-host test bed (tag "ssh") with sshd running
  inside each host, root login by key only; see kit_testbed/sshd.py for the API and for ``SshBed`` on a
  site bed (``site_bed`` in fixtures_testbed.py).
"""

from __future__ import annotations

import shutil

import pytest

from kit_testbed.sshd import SSHD, SshBed


@pytest.fixture(scope="session")
def ssh_bed(testbed_factory):
    if shutil.which(SSHD) is None or shutil.which("ssh-keygen") is None:
        pytest.skip("openssh-server / ssh-keygen not installed (scripts/setup --test installs them)")
    bed = testbed_factory(3, tag="ssh", held=True)
    sb = SshBed(bed)
    try:
        sb.start()
    except BaseException:
        sb.stop()
        raise
    yield sb
    sb.stop()
