"""Naming a dead JAX process (or its node) and waiting until Ray's view of the cluster is settled.

- `Lost`: a process that died (and the node it ran on); `Slot`: who one process is (index, host name,
  node IP, Ray node id, actor/worker id, pid), asked from the actor itself when it starts, so a failure
  can be named after the process is gone.
- `log_tail(slot)`: the last lines of its worker log through Ray's log API (bounded), or None when Ray
  cannot serve it any more (its node is gone); `log_location(slot)` says where the file is then.
- `failure_message(lost, slot, ...)`: the one line the user reads.
- `classify(errors, ...)`: which of a group's failed processes was LOST (its actor died, or the watchdog
  found it `Hung`: alive but silent), in the order to name them, or the one error of a process that
  raised on a live node (a bug, no restart).
- `view_settled(nodes, lost)`: Ray's node table no longer shows a lost node as alive (it was marked
  dead or removed), or the node is alive under a NEW id (its raylet restarted). Until then a new
  process could be placed on a node that is already gone (a --resume right after a loss crashed so).
- `wait_settled(lost, timeout_s)`: until every lost node is marked dead/gone by Ray, or answers a task
  pinned to it (then only the process died and the node may be used again). A node that is neither
  within the deadline is a one-line KitError naming it.

Imports on the Alpa image's stack (Python 3.9, ray 2.1.0): standard library at module level, ray when used.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

from alpa_job.cluster import ray_api
from alpa_job.errors import EXIT_PROCESS_LOST, EXIT_TIMEOUT, KitError

LOG_TAIL_LINES = 20
LOG_TIMEOUT_S = 5.0
SETTLE_TIMEOUT_S = 90.0  # Ray marks a silent node dead after its health checks fail (~15-30 s by default)
PROBE_TIMEOUT_S = 10.0


@dataclasses.dataclass
class Lost:
    """A JAX process that died (and the node it ran on)."""

    index: int
    host: Optional[str]
    ip: str
    node_id: str
    step: Optional[int] = None  # the last step it reported (None: it never reported one)
    reason: str = ""
    hung: bool = False  # alive but silent (the watchdog's Hung), rather than dead

    def where(self) -> str:
        return "process %d on host %s (node IP %s, Ray node id %s)" % (self.index, self.host or "?", self.ip, self.node_id or "?")


@dataclasses.dataclass
class Slot:
    """One JAX process as it described itself when it started."""

    index: int
    ip: str
    host: str = "?"
    node_id: str = ""
    actor_id: str = ""
    worker_id: str = ""
    pid: Optional[int] = None
    log_dir: str = ray_api.DEFAULT_LOGS_DIR  # its node's Ray log folder (moved by `ray start --temp-dir`)

    def lost(self, step: Optional[int], reason: str) -> Lost:
        return Lost(index=self.index, host=self.host, ip=self.ip, node_id=self.node_id, step=step, reason=reason)


def describe_self(index: int) -> Dict[str, Any]:
    """Run INSIDE a process's actor: its identity (the fields of Slot)."""
    import os
    import socket

    import ray

    ctx = ray.get_runtime_context()

    def hexid(getter: str, attr: str) -> str:
        try:
            value = getattr(ctx, getter)() if hasattr(ctx, getter) else getattr(ctx, attr)
            return value if isinstance(value, str) else value.hex()
        except Exception:  # an older/newer Ray without this id: the message just omits it
            return ""

    return {
        "index": index,
        "ip": ray.util.get_node_ip_address(),
        "host": socket.gethostname(),
        "node_id": hexid("get_node_id", "node_id"),
        "actor_id": hexid("get_actor_id", "actor_id"),
        "worker_id": hexid("get_worker_id", "worker_id"),
        "pid": os.getpid(),
        "log_dir": ray_api.logs_dir(),
    }


# ---- the log ------------------------------------------------------------------------------------
def _bounded(fn, timeout_s: float) -> Any:
    """fn() in a daemon thread; None when it fails or runs past `timeout_s` (a dead node's agent may hang)."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # the caller falls back to naming the file's location
            box["error"] = err

    t = threading.Thread(target=run, name="ray-log", daemon=True)
    t.start()
    t.join(timeout_s)
    return box.get("value")


def log_tail(slot: Slot, lines: int = LOG_TAIL_LINES, timeout_s: float = LOG_TIMEOUT_S) -> Optional[List[str]]:
    """The last `lines` lines of the process's worker log (stdout+stderr), or None when Ray cannot serve it."""
    try:
        from ray.util.state import get_log  # Ray >= 2.7
    except ImportError:
        try:
            from ray.experimental.state.api import get_log  # Ray 2.1 .. 2.6
        except ImportError:
            return None

    def read(suffix: str) -> List[str]:
        kw: Dict[str, Any] = {"tail": lines, "timeout": max(1, int(timeout_s))}
        if slot.actor_id:
            kw["actor_id"] = slot.actor_id
        else:
            kw.update(node_ip=slot.ip, pid=slot.pid)
        try:
            chunks = list(get_log(suffix=suffix, **kw))
        except TypeError:  # Ray 2.1's get_log has no `suffix`: it reads .out
            if suffix != "out":
                return []
            chunks = list(get_log(**kw))
        return "".join(chunks).splitlines()

    def both() -> List[str]:
        out = read("out")
        err = read("err")
        return (out + err)[-lines:]

    text = _bounded(both, timeout_s)
    return text or None


def log_location(slot: Slot) -> str:
    name = "worker-%s-*" % slot.worker_id if slot.worker_id else "worker-*-%s" % (slot.pid or "*")
    return "%s:%s/%s.{out,err}" % (slot.ip, slot.log_dir, name)


def failure_message(lost: Lost, slot: Optional[Slot], checkpoint_step: Optional[int], log_shown: bool, also: Sequence[int] = ()) -> str:
    step = "at step %d" % lost.step if lost.step is not None else "before its first step"
    verb = "hung" if lost.hung else "died"
    reason = lost.reason[len(HUNG) :].strip() if lost.hung and lost.reason.startswith(HUNG) else lost.reason
    saved = "last complete checkpoint: step %d" % checkpoint_step if checkpoint_step is not None else "no complete checkpoint yet"
    where = (
        "its log is printed above"
        if log_shown
        else ("read its log on that node: %s" % log_location(slot) if slot else "read its log under %s on that node" % ray_api.logs_dir())
    )
    others = (
        ("process(es) %s ended with it (JAX stops the peers of a dead process), the rest were stopped" % ", ".join(str(i) for i in also))
        if also
        else "the other processes were stopped"
    )
    return (
        "JAX %s %s %s (%s; %s); %s; %s; rerun with --resume (from the last checkpoint) or pass "
        "--max-restarts N to continue on the surviving nodes"
        % (lost.where(), verb, step, reason or "no reason given", saved, others, where)
    )


def print_log_tail(slot: Slot, lines: Optional[List[str]]) -> bool:
    if not lines:
        return False
    print(
        "[alpa_job] last %d lines of process %d's log (host %s, %s):" % (len(lines), slot.index, slot.host, log_location(slot)),
        file=sys.stderr,
    )
    for line in lines:
        print("  | " + line, file=sys.stderr)
    sys.stderr.flush()
    return True


def first_line(err: BaseException) -> str:
    for line in str(err).splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return type(err).__name__


# ---- which processes were lost ---------------------------------------------------------------------
JAX_ABORT = (
    "CoordinationServiceAgent::SetError",
    "detected fatal errors",
    "Terminating process because",
    "SIGABRT received",
)  # what JAX writes when its coordination service ends a dead peer's survivors


class Unresponsive(Exception):
    """A process whose actor stopped answering (its node gone without a connection reset telling us)."""


HUNG = "hung:"  # how a Hung's reason starts (the report's restart row and the lost line say it so)


class Hung(Unresponsive):
    """Alive but silent: a process whose step has not advanced for the watchdog's timeout (--hang-timeout).
    `answering` False: its actor does not answer either (the process is stopped or frozen, e.g. SIGSTOP);
    True: it answers but does not step (blocked on a silent peer, or stuck in its own code)."""

    def __init__(self, step: Optional[int], seconds: float, answering: bool):
        state = (
            "it answers Ray but does not step: blocked on a peer or stuck"
            if answering
            else "it does not answer Ray either: stopped, frozen or cut off"
        )
        super().__init__("%s no step for %.0f s (--hang-timeout); %s" % (HUNG, seconds, state))
        self.step, self.seconds, self.answering = step, seconds, answering


class GroupLost(Exception):
    """A worker group lost processes (their actors died); `lost` names them, the one to blame first."""

    def __init__(self, lost: List[Lost], slots: Dict[int, Slot], detected: float, wall: str):
        super().__init__(", ".join(x.where() for x in lost))
        self.lost, self.slots, self.detected, self.wall = lost, slots, detected, wall
        self.run_step: Optional[int] = None  # the furthest step any process had reached
        self.tails: Dict[int, Optional[List[str]]] = {}  # log tails already read while ranking the dead


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def classify(errors: Dict[int, BaseException], slots: Dict[int, Slot], steps: Dict[int, Optional[int]], detected: float) -> BaseException:
    """`errors` (process index -> error, in the order seen) as the exception to raise: a GroupLost naming
    the processes whose actors died, or a KitError for a process that raised while every actor lived."""
    import ray

    dead = {i: e for i, e in errors.items() if isinstance(e, (ray.exceptions.RayActorError, Unresponsive))}
    if not dead:
        # Every process is alive and one raised: a bug or a bad input, not a lost node; no restart.
        i, err = sorted(errors.items())[0]
        slot = slots.get(i)
        lines = log_tail(slot) if slot else None
        if slot:
            print_log_tail(slot, lines)
        who = f"process {i} on host {slot.host} ({slot.ip})" if slot else f"process {i}"
        return KitError(f"JAX {who} failed: {first_line(getattr(err, 'cause', None) or err)}", EXIT_PROCESS_LOST)
    # The lost one first: a node that stopped answering (Ray: "unavailable") over a process that died on a
    # live node (JAX's coordination service aborts the survivors of a dead peer: collateral), then by
    # arrival (`errors` keeps the order the failures were seen in).
    unreachable = tuple(t for t in (getattr(ray.exceptions, "ActorUnavailableError", None), Unresponsive) if t)
    arrival = list(errors)
    tails = _read_tails(dead, slots) if not any(isinstance(e, unreachable) for e in dead.values()) else {}
    collateral = {i for i, lines in tails.items() if lines and any(m in line for line in lines for m in JAX_ABORT)}
    order = sorted(dead, key=lambda i: (not isinstance(dead[i], unreachable), i in collateral, arrival.index(i)))
    lost = [slots[i].lost(steps.get(i), first_line(dead[i])) for i in order]
    for x, i in zip(lost, order):
        x.hung = isinstance(dead[i], Hung)
    failed = GroupLost(lost, slots, detected, _now_iso())
    failed.tails = tails
    failed.run_step = max((s for s in steps.values() if s is not None), default=None)
    return failed


def _read_tails(dead: Dict[int, BaseException], slots: Dict[int, Slot]) -> Dict[int, Optional[List[str]]]:
    """Several processes died on live nodes: their logs' tails, read at once (bounded), to tell the one to
    name from those JAX's coordination service aborted because a peer died (JAX_ABORT); the controller's
    report reuses them."""
    if len(dead) < 2:
        return {}
    tails: Dict[int, Optional[List[str]]] = {}

    def read(i: int) -> None:
        slot = slots.get(i)
        tails[i] = log_tail(slot, lines=60) if slot else None

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in dead]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LOG_TIMEOUT_S + 1)
    return dict(tails)


# ---- the settled view --------------------------------------------------------------------------
def view_settled(nodes: Iterable, lost: Sequence[Lost]) -> bool:
    """True when no lost node id is still listed alive (`nodes`: ray_api.RayNode rows, any state)."""
    lost_ids = {x.node_id for x in lost if x.node_id}
    return not any(n.alive and n.node_id in lost_ids for n in nodes)


def node_alive(nodes: Iterable, node_id: str) -> bool:
    return any(n.alive and n.node_id == node_id for n in nodes)


def current_nodes() -> List[ray_api.RayNode]:
    import ray

    return ray_api.parse_nodes(ray.nodes())


@dataclasses.dataclass
class Settled:
    """What waiting found: node ids Ray marked dead/gone, and node ids that are alive and answered."""

    dead: Set[str]
    healthy: Set[str]
    seconds: float


def wait_settled(lost: Sequence[Lost], timeout_s: float = SETTLE_TIMEOUT_S, poll_s: float = 0.5) -> Settled:
    """Block until every lost node is either gone from Ray's alive list, or alive and running a task
    pinned to it (bounded); a KitError naming the node past `timeout_s`."""
    import ray

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    todo = {x.node_id: x for x in lost if x.node_id}
    dead: Set[str] = set()
    healthy: Set[str] = set()

    @ray.remote(num_cpus=0)
    def here() -> str:  # ray only: the node may not import alpa_job without the job's runtime_env
        ctx = ray.get_runtime_context()  # a replacement node at the same IP answers too: compare ids
        return ctx.get_node_id() if hasattr(ctx, "get_node_id") else ctx.node_id.hex()

    probes: Dict[str, Any] = {nid: here.options(**ray_api.pin_to_node(x.ip)).remote() for nid, x in todo.items()}
    try:
        while todo:
            nodes = current_nodes()
            for nid in list(todo):
                if not node_alive(nodes, nid):
                    dead.add(nid)
                    todo.pop(nid)
            if probes and todo:
                ready, _ = ray.wait([probes[n] for n in todo], num_returns=len(todo), timeout=0)
                for nid in list(todo):
                    if probes[nid] in ready:
                        try:
                            answered = ray.get(probes[nid], timeout=1)
                        except Exception:  # the probe died with the node: Ray will mark it dead
                            continue
                        if answered and answered != nid:
                            continue  # a NEW node at that IP ran it: the lost one must still be marked dead
                        healthy.add(nid)
                        todo.pop(nid)
            if not todo:
                break
            if time.monotonic() > deadline:
                x = next(iter(todo.values()))
                raise KitError(
                    "the cluster did not settle within %.0f s: Ray still lists the node of %s as alive, "
                    "but it runs no task; check `ray status` and that node, then rerun with --resume" % (timeout_s, x.where()),
                    EXIT_TIMEOUT,
                )
            time.sleep(poll_s)
    finally:
        for ref in probes.values():
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already finished, or its node is gone
                pass
    return Settled(dead, healthy, time.monotonic() - t0)


def kill_all(actors: Sequence[Any]) -> None:
    """ray.kill every actor (no restart): survivors blocked in a collective with a dead peer go too."""
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already dead
            pass


# ---- the Alpa engine: its mesh workers are Alpa's own actors ----------------------------------------
def _actor_row(actor_id: str) -> Optional[Dict[str, Any]]:
    """{node_id, ip, pid, class_name} of an actor, dead ones included, from the GCS actor table (no
    dashboard needed; `ray.state` on Ray 2.1, `ray._private.state` later); None when Ray cannot say."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        from ray._private import state  # Ray >= 2.2
    except ImportError:
        state = getattr(ray, "state", None)  # Ray 2.1
    if state is None:
        return None
    row = _bounded(lambda: state.actors(actor_id), LOG_TIMEOUT_S)
    if not row:
        return None
    address = row.get("Address") or {}
    return {
        "node_id": address.get("NodeID") or "",
        "ip": address.get("IPAddress"),
        "pid": row.get("Pid"),
        "class_name": row.get("ActorClassName") or "",
    }


def actor_error_message(err: BaseException, what: str = "an Alpa mesh worker") -> str:
    """One line naming the node of the actor a RayActorError is about (host, IP, Ray node id, pid, class)
    as far as Ray can still tell, and where its log is."""
    import re

    actor_id = getattr(err, "actor_id", None) or ""
    if not actor_id:
        m = re.search(r"actor(?: ID)?[ :]+([0-9a-f]{16,})", str(err), re.IGNORECASE)
        actor_id = m.group(1) if m else ""
    row = _actor_row(actor_id) if actor_id else None

    def field(name: str) -> Any:
        return row.get(name) if row else None

    node_id = field("node_id") or ""
    ip, host = field("ip") or "?", "?"
    if node_id:
        try:
            for n in current_nodes():
                if n.node_id == node_id:
                    ip = n.ip
                    host = (n.row.get("NodeManagerHostname") if isinstance(n.row, dict) else None) or "?"
        except Exception:  # noqa: BLE001 - naming is best effort; the error itself is still reported
            pass
    pid = field("pid")
    cls = field("class_name") or ""
    where = (
        "on host %s (node IP %s, Ray node id %s%s)" % (host, ip, node_id, ", pid %s" % pid if pid else "")
        if node_id
        else "(Ray no longer knows its node%s)" % (": actor %s" % actor_id if actor_id else "")
    )
    # Only the actor record is left: the driver's own session folder is the best guess at its node's.
    logs = ray_api.logs_dir()
    log = "%s:%s/worker-*-%s.out" % (ip, logs, pid or "*") if node_id else "%s on that node" % logs
    return "%s%s died %s: %s; read its log at %s" % (what, " (%s)" % cls if cls else "", where, first_line(err), log)
