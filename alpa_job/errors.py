"""The one exception type for mistakes a user can fix.

The CLI catches `KitError` once, prints its one-line message to stderr and exits with its
`exit_code`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 2  # bad flag, bad file, bad combination: the message says what to change
EXIT_CHECK_FAILED = 3  # a check (doctor, guard) ran and found the cluster unhealthy
EXIT_TIMEOUT = 4  # a network wait ran past its deadline
EXIT_PROCESS_LOST = 1  # a JAX process or its node was lost (or failed) during the job
EXIT_DIVERGED = 1  # the loss became NaN or infinite: training failed part-way (report status "diverged")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: SIGTERM stopped the run at a saved step; rerun with --resume auto


class KitError(Exception):
    """A user-facing error: `str(err)` is one line that names the problem and the fix."""

    def __init__(self, message: str, exit_code: int = EXIT_USER_ERROR):
        super().__init__(" ".join(message.split()))  # always one line
        self.exit_code = exit_code


class LostProcessError(KitError):
    """A JAX process or its node was lost. The message already names the host, the node and the
    process's log (its last lines, or where it is), so no slower, cluster-wide log collection runs
    before the job exits: the failure is named within seconds."""

    def __init__(self, message: str, exit_code: int = EXIT_PROCESS_LOST):
        super().__init__(message, exit_code)


class Diverged(KitError):
    """The loss became NaN or infinite at `step`; `checkpoint_step` is the newest checkpoint saved before
    it (None: none), `losses` the run's losses up to where it stopped (for its report's loss curve). The
    run stops there and its report says `status: diverged`."""

    def __init__(
        self,
        message: str,
        step: "int | None" = None,
        checkpoint_step: "int | None" = None,
        exit_code: int = EXIT_DIVERGED,
        losses: "list | None" = None,
    ):
        super().__init__(message, exit_code)
        self.step, self.checkpoint_step, self.losses = step, checkpoint_step, list(losses or [])

    def __reduce__(self):  # across Ray (a worker's error reaches the driver pickled) with its fields
        return (Diverged, (str(self), self.step, self.checkpoint_step, self.exit_code, self.losses))
