"""How a playbook run looks to a person: live per-host progress while it runs, one screen at the end.

On a terminal: a rich table redrawn in place (host, current task, ok / changed / failed / unreachable
so far) under the current play. Elsewhere (CI logs, pipes): one line per play, per changed or failed
result, no redraws. `render_summary(summary)` is the end screen: per-host counts, failures (host, task,
message), duration, where the JSON and Ansible's own output are.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Dict, List, Optional, TextIO

from alpa_job.cluster.doctor.render import grid
from alpa_job.cluster.control.playbook import PlaybookSummary

MAX_FAILURES_SHOWN = 8


class Progress:
    """An `on_event` for run_playbook; use as a context manager (starts/stops the live display)."""

    def __init__(self, title: str, stream: Optional[TextIO] = None, live: Optional[bool] = None):
        self.title = title
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.play = ""
        self.task = ""
        self.hosts: Dict[str, Dict[str, Any]] = {}
        self.lock = threading.Lock()
        self._live = None

    def __enter__(self) -> "Progress":
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._table(), console=Console(file=self.stream), refresh_per_second=4, transient=True)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _host(self, name: str) -> Dict[str, Any]:
        return self.hosts.setdefault(name, {"task": "", "ok": 0, "changed": 0, "failed": 0, "unreachable": 0, "skipped": 0})

    def __call__(self, event: Dict[str, Any]) -> None:
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        host = data.get("host")
        with self.lock:
            if kind == "playbook_on_play_start":
                self.play = data.get("play") or data.get("name") or ""
                self._say("PLAY %s" % self.play)
            elif kind == "playbook_on_task_start":
                self.task = data.get("task") or ""
            elif kind == "runner_on_start" and host:
                self._host(host)["task"] = data.get("task") or ""
            elif kind in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable", "runner_on_skipped") and host:
                h = self._host(host)
                res = data.get("res") or {}
                if kind == "runner_on_ok":
                    h["ok"] += 1
                    if res.get("changed"):
                        h["changed"] += 1
                        self._say("  changed      %-10s %s" % (host, data.get("task") or ""))
                elif kind == "runner_on_skipped":
                    h["skipped"] += 1
                elif kind == "runner_on_unreachable":
                    h["unreachable"] += 1
                    self._say("  UNREACHABLE  %-10s %s: %s" % (host, data.get("task") or "", _msg(res)))
                elif data.get("ignore_errors"):
                    self._say("  failed (ignored) %-6s %s" % (host, data.get("task") or ""))
                else:
                    h["failed"] += 1
                    self._say("  FAILED       %-10s %s: %s" % (host, data.get("task") or "", _msg(res)))
            if self._live is not None:
                self._live.update(self._table())

    def _say(self, line: str) -> None:
        if self._live is None:
            print(line, file=self.stream, flush=True)

    def _table(self):
        from rich.table import Table

        table = Table(title="%s  [dim]%s[/dim]" % (self.title, self.play), title_justify="left", expand=False)
        for col, style in (
            ("host", "bold"),
            ("task", ""),
            ("ok", "green"),
            ("changed", "yellow"),
            ("failed", "red"),
            ("unreachable", "red"),
            ("skipped", "dim"),
        ):
            table.add_column(col, style=style, no_wrap=col != "task", max_width=60 if col == "task" else None)
        for name in sorted(self.hosts):
            h = self.hosts[name]
            table.add_row(name, h["task"], *(str(h[k]) for k in ("ok", "changed", "failed", "unreachable", "skipped")))
        return table


def _msg(res: Dict[str, Any]) -> str:
    from alpa_job.cluster.control.playbook import failure_message

    return failure_message(res)[:200]


def render_summary(summary: PlaybookSummary) -> str:
    """The one screen after a run."""
    verdict = "OK" if summary.ok else "FAILED (%s, exit %d)" % (summary.status, summary.rc)
    lines = [
        "%s%s on %s: %s in %.0f s, %d change(s)"
        % (summary.playbook, " --check" if summary.check else "", summary.inventory, verdict, summary.seconds, summary.changed),
        "",
    ]
    if summary.hosts:
        keys = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")
        lines += grid(("host",) + keys, [(h,) + tuple(str(c.get(k, 0)) for k in keys) for h, c in sorted(summary.hosts.items())])
        lines.append("")
    shown: List[Dict[str, Any]] = [f for f in summary.failures if not f.get("ignored")]
    for f in shown[:MAX_FAILURES_SHOWN]:
        where = "%s: %s" % (f["host"], f["task"]) if f["host"] else "ansible-playbook"
        lines.append("%s %s: %s" % ("UNREACHABLE" if f.get("unreachable") else "FAILED", where, f["message"][:300]))
    if len(shown) > MAX_FAILURES_SHOWN:
        lines.append("... and %d more failure(s): see the JSON" % (len(shown) - MAX_FAILURES_SHOWN))
    if shown:
        lines.append("")
    lines.append("summary: %s/summary.json   ansible output: %s/stdout" % (summary.run_dir, summary.artifact_dir))
    return "\n".join(lines)
