"""alpa_job/cluster/control without a test bed: a real ansible-runner run of a small playbook (local connection), the
inventory as Ansible reads it, the status comparison and the log selection rules (plain data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alpa_job.errors import KitError

REPO = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO / ".venv" / "bin" / "python"

PLAYBOOK = """
- name: Two hosts, one task each way.
  hosts: all
  gather_facts: false
  tasks:
    - name: Say hello
      ansible.builtin.command: echo hello
    - name: Fail on b
      ansible.builtin.command: sh -c 'echo it broke >&2; exit 7'
      when: inventory_hostname == 'b'
    - name: Skipped everywhere
      ansible.builtin.debug:
        msg: never
      when: false
"""


@pytest.fixture
def local_play(tmp_path):
    pytest.importorskip("ansible_runner", reason="pip install -r requirements/dev.txt")
    project = tmp_path / "project"
    project.mkdir()
    (project / "play.yml").write_text(PLAYBOOK)
    inventory = tmp_path / "hosts.yml"
    local = {"ansible_connection": "local", "ansible_python_interpreter": str(VENV_PYTHON)}
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"a": local, "b": local}}}))
    return project, inventory


def test_run_playbook_summarises_counts_failures_and_timing(local_play, tmp_path):
    from alpa_job.cluster.control.playbook import run_playbook
    from alpa_job.cluster.control.playbook_view import Progress, render_summary

    project, inventory = local_play
    seen = []
    summary = run_playbook(
        "play.yml", str(inventory), run_dir=str(tmp_path / "run"), ansible_dir=str(project), on_event=lambda e: seen.append(e["event"])
    )
    assert not summary.ok and summary.status == "failed" and summary.rc == 2
    # Ansible's RECAP numbers, per host
    assert summary.hosts == {
        "a": {"ok": 1, "changed": 1, "unreachable": 0, "failed": 0, "skipped": 2, "rescued": 0, "ignored": 0},
        "b": {"ok": 1, "changed": 1, "unreachable": 0, "failed": 1, "skipped": 0, "rescued": 0, "ignored": 0},
    }
    assert summary.failures == [
        {
            "host": "b",
            "task": "Fail on b",
            "play": "Two hosts, one task each way.",
            "message": "non-zero return code: it broke",
            "unreachable": False,
            "ignored": False,
        }
    ]
    assert [d["task"] for d in summary.slowest][:1] in (["Say hello"], ["Fail on b"])
    assert "playbook_on_task_start" in seen and "playbook_on_stats" in seen  # the live view's feed
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["hosts"] == summary.hosts and on_disk["failures"] == summary.failures and not on_disk["ok"]
    assert "TASK [Fail on b]" in summary.stdout()  # ansible-playbook's own output, kept in the artifacts
    screen = render_summary(summary)
    assert "FAILED b: Fail on b: non-zero return code: it broke" in screen
    assert str(tmp_path / "run" / "summary.json") in screen
    # the non-terminal progress: a line per play, per change, per failure
    lines = []

    class Sink:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

        def isatty(self):
            return False

    with Progress("play.yml", stream=Sink()) as progress:
        run_playbook("play.yml", str(inventory), run_dir=str(tmp_path / "run2"), ansible_dir=str(project), on_event=progress)
    text = "".join(lines)
    assert "PLAY Two hosts" in text and "FAILED       b          Fail on b: non-zero return code: it broke" in text


def test_run_playbook_reports_a_broken_playbook_in_ansibles_words(local_play, tmp_path):
    from alpa_job.cluster.control.playbook import run_playbook

    project, inventory = local_play
    (project / "broken.yml").write_text("- hosts: all\n  tasks:\n    - name: x\n      no.such.module: {}\n")
    summary = run_playbook("broken.yml", str(inventory), run_dir=str(tmp_path / "run"), ansible_dir=str(project))
    assert not summary.ok and summary.hosts == {}
    assert len(summary.failures) == 1 and summary.failures[0]["host"] == ""
    assert "no.such.module" in summary.failures[0]["message"]


def test_the_example_inventory_as_the_cluster_commands_read_it():
    pytest.importorskip("ansible_runner", reason="pip install -r requirements/dev.txt")
    from alpa_job.cluster.control.inventory import load_inventory

    inv = load_inventory(str(REPO / "ansible" / "inventory" / "example.yml"))
    assert (inv.head.name, inv.head.address, inv.head.user) == ("node1", "10.0.0.1", "root")
    assert [(w.name, w.address) for w in inv.workers] == [("node2", "10.0.0.2"), ("node3", "10.0.0.3")]
    assert inv.runtime == "docker" and inv.gpus is True
    assert inv.spec().cluster_cidr == "10.0.0.0/8"
    assert inv.image() == "registry.example.com:5000/" + inv.spec().images["jax"]
    assert inv.image_source() == "pull"
    assert inv.ray_log_dir(inv.head) == "/var/lib/alpa-kit/ray/session_latest/logs"


def _inventory(tmp_path, heads, workers, vars_=None):
    path = tmp_path / "hosts.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "ray_cluster": {
                    "children": {
                        "ray_head": {"hosts": {n: {"ansible_host": ip} for n, ip in heads} or None},
                        "ray_workers": {"hosts": {n: {"ansible_host": ip} for n, ip in workers} or None},
                    },
                    "vars": vars_ or {},
                }
            }
        )
    )
    return str(path)


def test_inventory_mistakes_are_one_line_errors(tmp_path):
    pytest.importorskip("ansible_runner", reason="pip install -r requirements/dev.txt")
    from alpa_job.cluster.control.inventory import load_inventory

    with pytest.raises(KitError, match=r"group ray_head must hold exactly one host .* it holds 2: a, b"):
        load_inventory(_inventory(tmp_path, [("a", "10.1.0.1"), ("b", "10.1.0.2")], []))
    inv = load_inventory(_inventory(tmp_path, [("a", "10.1.0.1")], [], {"alpa_kit_cluster_cidr": "{{ my_cidr }}"}))
    with pytest.raises(KitError, match=r"alpa_kit_cluster_cidr of host a is a template"):
        inv.spec()
    inv = load_inventory(_inventory(tmp_path, [("a", "10.1.0.1")], [], {"alpa_kit_ports": {"dashboard": 8266}}))
    assert inv.spec().ports["dashboard"] == 8266 and inv.spec().ports["gcs"] == 6379  # merged key by key
    with pytest.raises(KitError, match=r"inventory .*nope.yml not found"):
        load_inventory(str(tmp_path / "nope.yml"))


def test_status_compare_names_each_difference(tmp_path):
    pytest.importorskip("ansible_runner", reason="pip install -r requirements/dev.txt")
    from alpa_job.cluster.control.inventory import load_inventory
    from alpa_job.cluster.control.status import compare

    inv = load_inventory(
        _inventory(tmp_path, [("h", "10.1.0.1")], [("w1", "10.1.0.2"), ("w2", "10.1.0.3")], {"alpa_kit_cluster_cidr": "10.1.0.0/24"})
    )

    def node(ip, head=False, alive=True):
        return {"ip": ip, "alive": alive, "head": head, "state_message": None if alive else "raylet died"}

    assert compare(inv, [node("10.1.0.1", True), node("10.1.0.2"), node("10.1.0.3")]) == []
    problems = compare(inv, [node("10.1.0.1", True), node("10.1.0.2"), node("10.1.0.3", alive=False), node("10.1.0.9")])
    assert [p["node"] for p in problems] == ["w2", "10.1.0.9"]
    assert "its Ray node is dead: raylet died" in problems[0]["problem"]
    assert "alive but not in the inventory" in problems[1]["problem"]
    problems = compare(inv, [node("10.1.0.1"), node("10.1.0.2", True), node("10.1.0.3")])
    assert [p["node"] for p in problems] == ["h", "w1"]


def test_job_log_selection():
    from alpa_job.cluster.control.logs import JobRef

    job = JobRef("raysubmit_abc", job_id="03000000", submission_id="raysubmit_abc")
    keep = [
        "raylet.out",
        "gcs_server.err",
        "dashboard_agent.log",
        "events/event_RAYLET.log",
        "worker-aa11-03000000-42.out",
        "worker-aa11-03000000-42.err",
        "job-driver-raysubmit_abc.log",
        "python-core-driver-03000000ffffffff_9.log",
        "worker-cc33-ffffffff-7.out",
    ]
    drop = [
        "worker-bb22-02000000-41.out",
        "job-driver-raysubmit_other.log",
        "python-core-worker-bb22_41.log",
        "python-core-driver-02000000ffffffff_8.log",
    ]
    assert [f for f in keep + drop if job.keeps(f)] == keep
