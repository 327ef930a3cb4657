"""Progress for long work (compile, search, epochs): a bar on a terminal, plain lines elsewhere.

Under `ray job submit` and inside Ray actors stderr is not a terminal and carriage-return bars
turn into noise, so there we print one line per update instead.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional


def _is_tty() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


class Progress:
    def __init__(self, desc: str, total: Optional[int], unit: str = "step"):
        self.desc, self.total, self.unit, self.n = desc, total, unit, 0
        self._bar = None
        self._last_line = 0.0
        if _is_tty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
            except ImportError:  # tqdm is optional on the legacy image
                self._bar = None

    def update(self, n: int = 1, **postfix: object) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            return
        now = time.monotonic()
        done = self.total is not None and self.n >= self.total
        if done or now - self._last_line >= 2.0:
            self._last_line = now
            of = f"/{self.total}" if self.total else ""
            extra = " ".join(f"{k}={v}" for k, v in postfix.items())
            print(f"[{self.desc}] {self.n}{of} {self.unit}s {extra}".rstrip(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def timed(message: str) -> Iterator[None]:
    """`compiling train step ...` then `... done in 3.2 s`."""
    note(f"{message} ...")
    start = time.perf_counter()
    yield
    note(f"{message} done in {time.perf_counter() - start:.1f} s")
