"""The loop of hooks: each hook runs on its own cadence with one signature, sees the step it is at, and can
read losses back or take its time out of the timing windows; the loop returns a typed result."""

import time

from helpers_train import tiny_config

from alpa_job.models import get_model
from alpa_job.train import hooks
from alpa_job.train.loop import LoopResult, build_jax_engine, loop_hooks, prepare_data, run_loop


class EveryThird(hooks.Hook):
    """Reads the losses back every third step and sleeps, its time taken out of the step's timing."""

    every = 3

    def __init__(self):
        self.seen, self.read, self.started, self.finished = [], [], False, None

    def start(self, loop):
        self.started = True

    def after_step(self, loop):
        self.seen.append(loop.global_step)
        self.read.append(len(loop.read_back()))
        began = time.perf_counter()
        time.sleep(0.2)
        loop.timer.exclude(time.perf_counter() - began)

    def finish(self, loop):
        self.finished = loop.steps


def _loop(config, *extra):
    data = prepare_data(config, get_model(config))
    engine = build_jax_engine(config, get_model(config), data)
    stream = data.stream(10)
    run_hooks = loop_hooks(stream, 0, 10) + list(extra)
    return run_loop(engine, engine.init_state(0), stream, 0, 10, run_hooks)


def test_a_hook_runs_on_its_own_cadence_and_its_time_is_not_a_steps():
    config = tiny_config("mlp", steps=10, devices=2, out=None)
    every_third = EveryThird()
    _, result = _loop(config, every_third)
    assert isinstance(result, LoopResult) and result.steps == 10 and len(result.losses) == 10
    assert every_third.started and every_third.seen == [3, 6, 9] and every_third.finished == 10
    assert every_third.read[0] >= 1 and sum(every_third.read) <= 9  # what was pending when it asked
    assert result.first_step_s is not None and result.window_step_s  # the timer hook ran too
    # Three 0.2 s sleeps inside the timed windows, each taken out: no window carries one.
    assert max(result.window_step_s) < 0.2, result.window_step_s
    assert result.statistics()["steps"] == 10 and result.stopped_at is None
