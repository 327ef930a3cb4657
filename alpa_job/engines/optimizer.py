"""The default optimizer: Adam with a linear warmup then cosine decay, for every engine.

Why a schedule: at a constant --learning-rate 1e-3 from the first step, Adam moves every weight of
a freshly initialised wide model by ~lr per step in a consistent direction, and a wide GPT's loss
rose over its first steps instead of falling. Warming up over the first fifth of the run
(at most 1000 steps) and decaying to a tenth of the peak by the last step is the standard remedy.

`--learning-rate` is the peak; the horizon is `schedule_steps`. With no known run length (epochs over a dataset of unknown size),
the rate warms up over 100 steps and then stays at the peak.

Python 3.9; optax imported lazily (optax 0.1.x in the Alpa image has these schedules too).
"""

from __future__ import annotations

import math
from typing import Optional

MAX_WARMUP_STEPS = 1000
UNKNOWN_LENGTH_WARMUP_STEPS = 100
END_FRACTION = 0.1  # the rate at the last step, as a fraction of the peak


def schedule_steps(config, steps_per_epoch: int) -> int:
    """The schedule's horizon: the run's planned length, --epochs over the dataset, or --steps when
    that is longer. --steps shorter than the epochs only stops the run early; it does not squeeze
    the schedule, so a run stopped at step N and resumed follows the same rates as one that never
    stopped (resuming depends on it)."""
    return max(config.epochs * steps_per_epoch, config.steps or 0)


def warmup_steps(total_steps: Optional[int]) -> int:
    if not total_steps:
        return UNKNOWN_LENGTH_WARMUP_STEPS
    return max(1, min(MAX_WARMUP_STEPS, total_steps // 5))


def learning_rate_schedule(peak: float, total_steps: Optional[int]):
    """step -> learning rate (an optax schedule)."""
    import optax

    warmup = warmup_steps(total_steps)
    start = peak / (warmup + 1)  # never 0: the first step already moves
    if not total_steps or total_steps <= warmup:
        return optax.join_schedules([optax.linear_schedule(start, peak, warmup), optax.constant_schedule(peak)], [warmup])
    return optax.warmup_cosine_decay_schedule(
        init_value=start, peak_value=peak, warmup_steps=warmup, decay_steps=total_steps, end_value=peak * END_FRACTION
    )


def learning_rate_at(peak: float, total_steps: Optional[int], count: int) -> float:
    """`learning_rate_schedule(peak, total_steps)(count)` in plain Python: the rate of the update made
    with optax's step count `count` (the update that ends global step count + 1). For the run's metrics:
    the host reads it without a device computation (the schedule itself is a jax function)."""
    warmup = warmup_steps(total_steps)
    start = peak / (warmup + 1)
    if count < warmup:
        return start + (peak - start) * count / warmup
    if not total_steps or total_steps <= warmup:
        return peak
    done = min(count - warmup, total_steps - warmup) / (total_steps - warmup)
    end = peak * END_FRACTION
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * done))


def default_optimizer(peak_learning_rate: float, total_steps: Optional[int]):
    """Adam under `learning_rate_schedule`."""
    import optax

    return optax.adam(learning_rate_schedule(peak_learning_rate, total_steps))
