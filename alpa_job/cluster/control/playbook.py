"""Run ansible/site.yml or teardown.yml through ansible-runner and say what happened, as data.

    summary = run_playbook("site.yml", "inventory/hosts.yml", run_dir="runs/cluster-up")
    summary.ok, summary.hosts["w1"]["changed"], summary.failures[0]["message"], summary.seconds

`PlaybookSummary` is what a person or a test needs from a run: per-host counts (Ansible's RECAP:
ok, changed, unreachable, failed, skipped, rescued, ignored), each failure's host, task and message,
the duration, the exit code; `write_json()` puts it in the run dir next to ansible-runner's artifacts
(stdout, every event as JSON). An event handler sees every task start and result as it happens
(playbook_view.py draws live progress from them). The playbook runs with the checkout's ansible.cfg
(ansible-runner's cwd is ansible/) and the venv's ansible-playbook.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from alpa_job.errors import KitError
from alpa_job.cluster.control.inventory import ANSIBLE_DIR, tool_env
from alpa_job import strict_json

PLAYBOOKS = {"up": "site.yml", "down": "teardown.yml"}
COUNTS = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")
# ansible-runner's stats keys -> the RECAP's names
_STATS_KEYS = {
    "ok": "ok",
    "changed": "changed",
    "dark": "unreachable",
    "failures": "failed",
    "skipped": "skipped",
    "rescued": "rescued",
    "ignored": "ignored",
}
SUMMARY_FILE = "summary.json"
SLOWEST_SHOWN = 12
DEFAULT_TIMEOUT_S = 1800


@dataclass
class PlaybookSummary:
    playbook: str
    inventory: str
    check: bool
    rc: int
    status: str  # ansible-runner's: successful | failed | timeout | canceled
    seconds: float
    hosts: Dict[str, Dict[str, int]] = field(default_factory=dict)  # host -> COUNTS
    failures: List[Dict[str, Any]] = field(default_factory=list)  # {host, task, message, unreachable, ignored}
    # the slowest tasks: {"task" ("role : name"), "seconds" (the slowest host's), "host"}, slowest first
    slowest: List[Dict[str, Any]] = field(default_factory=list)
    run_dir: str = ""
    artifact_dir: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.status == "successful"

    @property
    def changed(self) -> int:
        return sum(h.get("changed", 0) for h in self.hosts.values())

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["ok"], d["changed_total"] = self.ok, self.changed
        return d

    def write_json(self, path: Optional[str] = None) -> str:
        path = path or os.path.join(self.run_dir, SUMMARY_FILE)
        with open(path, "w") as f:
            strict_json.dump(self.to_dict(), f, indent=2, sort_keys=True)
        return path

    def stdout(self) -> str:
        """ansible-playbook's own output (what a terminal would have shown)."""
        try:
            with open(os.path.join(self.artifact_dir, "stdout"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def failure_message(res: Mapping[str, Any]) -> str:
    """One line from a failed/unreachable task's result: Ansible's msg, plus the command's last stderr line
    when the msg alone says nothing ("non-zero return code", "MODULE FAILURE")."""
    msg = str(res.get("msg") or "").strip()
    if not msg and res.get("results"):  # a loop: the first failed item's message
        for item in res["results"]:
            if isinstance(item, Mapping) and item.get("failed"):
                return failure_message(item)
    if not msg or msg == "non-zero return code" or msg.startswith("MODULE FAILURE"):
        for key in ("stderr", "module_stderr", "stdout", "module_stdout"):
            text = str(res.get(key) or "").strip()
            if text:
                msg = "%s%s" % (msg + ": " if msg else "", text.splitlines()[-1])
                break
    return " ".join(msg.split())[:1000] or "(no message)"


def ansible_error(stdout: str) -> str:
    """The ERROR line Ansible printed (and where it points), else its last lines; one line."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in stdout.splitlines()]
    lines = [line for line in lines if line]
    for i, line in enumerate(lines):
        if line.startswith(("ERROR!", "[ERROR]")):
            return " ".join(" ".join(lines[i : i + 2]).split())[:1000]
    return " ".join(" ".join(lines[-3:]).split())[:1000]


class EventCollector:
    """Folds ansible-runner events into counts and failures; forwards each event to `on_event`."""

    def __init__(self, on_event: Optional[Callable[[Dict[str, Any]], None]] = None):
        self.on_event = on_event
        self.failures: List[Dict[str, Any]] = []
        self.stats: Optional[Dict[str, Any]] = None
        self.durations: Dict[str, Dict[str, Any]] = {}  # task -> its slowest host's result

    def slowest(self, n: int = SLOWEST_SHOWN) -> List[Dict[str, Any]]:
        return sorted(self.durations.values(), key=lambda d: -d["seconds"])[:n]

    def __call__(self, event: Dict[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        if kind in ("runner_on_failed", "runner_on_unreachable", "runner_item_on_failed") and data.get("host"):
            res = data.get("res") or {}
            if kind != "runner_item_on_failed":  # the item's failure comes again as the task's
                self.failures.append(
                    {
                        "host": data["host"],
                        "task": data.get("task") or "",
                        "play": data.get("play") or "",
                        "message": failure_message(res),
                        "unreachable": kind == "runner_on_unreachable",
                        "ignored": bool(data.get("ignore_errors")),
                    }
                )
        if kind in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable") and data.get("duration") is not None:
            task = "%s : %s" % (data["role"], data.get("task") or "") if data.get("role") else data.get("task") or ""
            seconds = round(float(data["duration"]), 2)
            if seconds > self.durations.get(task, {}).get("seconds", -1):
                self.durations[task] = {"task": task, "seconds": seconds, "host": data.get("host")}
        if kind == "playbook_on_stats":
            self.stats = data
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a display problem must never stop the play
                pass
        return True  # keep the event in the artifacts


def host_counts(stats: Optional[Mapping[str, Any]]) -> Dict[str, Dict[str, int]]:
    """{host: {ok, changed, unreachable, failed, skipped, rescued, ignored}} from the stats event/runner.stats."""
    hosts: Dict[str, Dict[str, int]] = {}
    if not stats:
        return hosts
    names = set()
    for key in list(_STATS_KEYS) + ["processed"]:
        names.update((stats.get(key) or {}).keys())
    for host in sorted(names):
        hosts[host] = {name: int((stats.get(key) or {}).get(host, 0)) for key, name in _STATS_KEYS.items()}
    return hosts


def run_playbook(
    playbook: str,
    inventory: str,
    check: bool = False,
    run_dir: Optional[str] = None,
    extravars: Optional[Mapping[str, Any]] = None,
    cmdline: Sequence[str] = (),
    on_event: Optional[Callable[[Dict[str, Any]], None]] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    envvars: Optional[Mapping[str, str]] = None,
    ansible_dir: str = ANSIBLE_DIR,
) -> PlaybookSummary:
    """Run `playbook` (a file of ansible/) against `inventory`; never raises for a failed play (see .ok).

    `check`: --check (nothing changes). `run_dir`: ansible-runner's private data dir (artifacts/<ident>/:
    stdout, job_events/) and summary.json; default runs/cluster-<playbook>-<time>. `timeout_s`: the run is
    stopped past it (status "timeout"). `cmdline`: extra ansible-playbook arguments.
    """
    try:
        import ansible_runner
    except ImportError:
        raise KitError(
            "the cluster commands need ansible-runner on the controller: pip install -r requirements/dev.txt (scripts/setup --test)"
        ) from None
    if not os.path.isfile(os.path.join(ansible_dir, playbook)):
        raise KitError("no playbook %s in %s" % (playbook, ansible_dir))
    inventory = os.path.abspath(inventory)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = os.path.abspath(run_dir or os.path.join("runs", "cluster-%s-%s" % (playbook.split(".")[0], stamp)))
    os.makedirs(run_dir, exist_ok=True)
    ident = "%s-%s" % (playbook.split(".")[0], stamp)
    args = list(cmdline) + (["--check"] if check else [])
    env = dict(tool_env())
    env.update(ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1")  # artifacts and messages in plain text
    env.update(envvars or {})
    collector = EventCollector(on_event)
    t0 = time.monotonic()
    saved_path = os.environ.get("PATH")
    os.environ["PATH"] = env["PATH"]  # ansible-runner looks ansible-playbook up in this process's PATH
    try:
        runner = ansible_runner.run(
            private_data_dir=run_dir,
            project_dir=ansible_dir,
            playbook=playbook,
            inventory=inventory,
            cmdline=" ".join(args) or None,
            extravars=dict(extravars or {}),
            envvars=env,
            event_handler=collector,
            quiet=True,
            ident=ident,
            timeout=int(timeout_s),
            rotate_artifacts=0,
        )
    finally:
        if saved_path is not None:
            os.environ["PATH"] = saved_path
    seconds = time.monotonic() - t0
    stats = collector.stats or runner.stats
    summary = PlaybookSummary(
        playbook=playbook,
        inventory=inventory,
        check=check,
        rc=int(runner.rc or 0),
        status=str(runner.status),
        seconds=round(seconds, 1),
        hosts=host_counts(stats),
        failures=collector.failures,
        slowest=collector.slowest(),
        run_dir=run_dir,
        artifact_dir=os.path.join(run_dir, "artifacts", ident),
    )
    if runner.status == "timeout":
        summary.failures.append(
            {
                "host": "",
                "task": "",
                "play": "",
                "unreachable": False,
                "ignored": False,
                "message": "the run passed its %d s limit and was stopped" % timeout_s,
            }
        )
    elif not summary.ok and not [f for f in summary.failures if not f["ignored"]]:
        # ansible-playbook failed before any task (a syntax or inventory error): its own words
        summary.failures.append(
            {
                "host": "",
                "task": "",
                "play": "",
                "unreachable": False,
                "ignored": False,
                "message": ansible_error(summary.stdout()) or "ansible-playbook exit %d" % summary.rc,
            }
        )
    summary.write_json()
    return summary
