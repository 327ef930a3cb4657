"""The suite's own layout (tests/conftest.py, tests/fixtures_testbed.py): which modules share the test-bed
lane and in what order, and when a bed is taken down. Read from the code; no bed is built."""

from __future__ import annotations

import glob
import os
from pathlib import PurePath

import conftest
import fixtures_testbed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_module_the_lane_order_names_is_a_test_bed_module():
    modules = {PurePath(p).stem: p for p in glob.glob(os.path.join(REPO, "tests", "test_*.py"))}
    for stem in conftest.BED_LANE_ORDER:
        assert stem in modules, f"BED_LANE_ORDER names {stem}, which is not a test module"
        assert conftest.group_of(f"tests/{stem}.py::x") == conftest.BED_LANE, stem
    assert len(set(conftest.BED_LANE_ORDER)) == len(conftest.BED_LANE_ORDER)
    # A module that uses no bed stays out of the lane, whatever its name says.
    assert conftest.group_of("tests/test_settings_catalog.py::x") == "test_settings_catalog"


class _Bed:
    def __init__(self):
        self.downs = 0

    def down(self):
        self.downs += 1


def test_a_bed_goes_down_once_none_of_the_modules_that_asked_for_it_is_left():
    beds = fixtures_testbed._Beds()
    node_loss, site = _Bed(), _Bed()
    beds.beds = {("nodeloss",): node_loss, ("site",): site}
    beds.asked_by = {("nodeloss",): {"test_node_loss", "test_watchdog_testbed"}}  # site: a fixture's (held) bed
    beds.release_unless(lambda module: module == "test_watchdog_testbed")  # still to come
    assert node_loss.downs == 0
    beds.release_unless(lambda module: False)
    assert node_loss.downs == 1 and ("nodeloss",) not in beds.asked_by
    beds.release_unless(lambda module: False)  # released once; a held bed is never released here
    assert node_loss.downs == 1 and site.downs == 0


def test_beside_the_lane_a_test_runs_at_the_lower_priority_and_the_processes_it_starts_too():
    """This module is not a bed module: under xdist it runs niced, and a child process inherits that."""
    import subprocess
    import sys

    expected = conftest.BESIDE_THE_LANE_NICE if os.environ.get("PYTEST_XDIST_WORKER") else 0
    assert os.getpriority(os.PRIO_PROCESS, 0) == expected
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"], capture_output=True, text=True)
    assert int(child.stdout) == expected
