"""Process 0's progress across Ray: its events, batched in its actor, shown by the driver's display.

Process 0 trains in a Ray actor, so its events cannot reach the driver's display by a function call. Its
sink batches them into a `ProgressChannel`: steps and metrics wait for a fire-and-forget call at most
every FLUSH_INTERVAL_S, the other events (phases, notes) go at once, and training never waits on the
driver, which drains the channel while it waits for the training. Ray is imported only where a channel is
opened or drained (the driver), never by importing this module.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, List, Optional

from alpa_job.progress.display import Display, Event
from alpa_job.progress.events import display, set_sink

FLUSH_INTERVAL_S = 0.5  # actor -> driver batching


class ProgressChannel:
    """Carries process 0's progress events from its Ray actor to the driver's display.

    Driver:  `channel = ProgressChannel.open()`; hand it to process 0's actor in the training call;
             call `channel.deliver()` while waiting for the training (it shows what arrived since).
    Actor:   `send_to(channel)` once before training: this process's events go through it;
             `send_to(None)` keeps them in the worker's own log (the processes other than 0).
    The events travel through a tiny actor (num_cpus=0: it never takes a node's training CPU); this
    object is its handle and is passed to the worker like any argument of a Ray call.
    """

    def __init__(self, actor: Any):
        self._actor = actor

    @classmethod
    def open(cls) -> "ProgressChannel":
        return cls(_channel_actor_class().remote())

    def push(self, events: List[Event]) -> None:
        """Actor side: hand `events` over without waiting for the driver."""
        self._actor.push.remote(events)

    def deliver(self, to: Optional[Display] = None, timeout_s: float = 10) -> None:
        """Driver side: show the events that arrived on `to` (default: this process's display).
        Best effort: the training's futures, not the progress, carry its errors."""
        import ray

        try:
            events = ray.get(self._actor.drain.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a lost progress line is not a failure
            return
        shown = to or display()
        for event in events:
            shown.handle(event)


@functools.lru_cache(maxsize=None)
def _channel_actor_class():
    """The channel's actor class (made once: Ray registers each class it is given)."""
    import ray

    @ray.remote(num_cpus=0)
    class ProgressChannelActor:
        def __init__(self):
            self.events: List[Event] = []

        def push(self, events: List[Event]) -> None:
            self.events.extend(events)

        def drain(self) -> List[Event]:
            out, self.events = self.events, []
            return out

    return ProgressChannelActor


BATCHED = ("step", "metrics")  # events that wait for the next batch (the others go at once)


class _ChannelSink:
    """Process 0's sink inside a Ray actor: batches events into its `ProgressChannel`."""

    def __init__(self, channel: ProgressChannel):
        self.channel = channel
        self.pending: List[Event] = []
        self.last_flush = 0.0

    def __call__(self, event: Event) -> None:
        self.pending.append(event)
        now = time.monotonic()
        if event["kind"] not in BATCHED or event.get("last") or now - self.last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.channel.push(self.pending)  # fire and forget: never waits on the driver
            self.pending = []
        self.last_flush = time.monotonic()


def _null_sink(event: Event) -> None:
    if event["kind"] in ("phase", "note"):  # still in the worker's own log (ray logs / -v)
        print(event["text"], file=sys.stderr, flush=True)


def send_to(channel: Optional[ProgressChannel]) -> None:
    """In a Ray actor: send this process's events through `channel` (None: keep them in its own log)."""
    set_sink(_ChannelSink(channel) if channel is not None else _null_sink)
