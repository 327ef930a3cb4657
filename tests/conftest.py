"""Shared pytest configuration. Fixtures live in tests/fixtures_*.py; list yours below."""

import collections
import functools
import os
import re
from pathlib import Path, PurePath

import pytest

# In-process engine tests see 8 emulated CPU devices; must be set before anything imports jax.
# The suite compiles far more than it runs (tiny models, a few steps), so XLA:CPU's code generator skips
# its expensive optimisations: every compile, here and in every process the tests start (test-bed hosts
# included: they inherit this environment), takes about a quarter less time. Every run of a test is
# compiled alike, so comparisons between runs are unaffected.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray starts its workers at nice 15; in this suite they are the training itself (the test bed's JAX processes,
# a local Ray's actors), and at 15 the rest of a busy machine starves them. At 0 they keep the priority of the
# worker that started their Ray (see BESIDE_THE_LANE_NICE).
os.environ.setdefault("RAY_worker_niceness", "0")

# `import alpa_job`, the fixture modules and the test bed's package by name: pyproject.toml's `pythonpath`.
REPO_ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = [
    "fixtures_spec",  # spec (package defaults); no test sees a user's ALPA_KIT_CLUSTER_SPEC
    "fixtures_testbed",  # testbed_factory, testbed, ray_cluster (multi-host test bed; needs root)
    "fixtures_multihost",  # mgmt_cluster (2 hosts with a management NIC), run_doctor helper
    "fixtures_ssh",  # ssh_bed: sshd inside 3 test-bed hosts (Ansible over real SSH)
]


# ---- running in parallel (pytest-xdist, `-n 2` in pyproject.toml) -------------------------------------
# Every module that builds test beds (or a site from them) runs on ONE worker, one after the other: two
# beds' Ray clusters side by side overload two cores (tried twice: Gloo's 30 s rendezvous and the doctor's
# 10 s probes time out), and the beds share a machine-wide lock. The image build (test_image_build: no bed,
# no Ray cluster) runs on the other worker: its writes to the image cache the site bed also builds into
# wait for the cache's lock (testbed_site.image_cache_lock). The other worker
# takes the rest, a module at a time (its module-scoped fixtures built once), heaviest first. Found from
# the source, so a new test-bed module joins the lane: by the marker, or a bed fixture among a function's
# arguments (a test's or another fixture's), not the words alone, which also name e.g. the Ansible role
# `ray_cluster`.
BED_USE = re.compile(
    r"mark\.testbed\b|def \w+\((?:[^)]*,)?\s*(testbed|testbed_factory|ray_cluster|mgmt_cluster|ssh_bed|"
    r"site_bed)\s*[,):=]"
)
BED_LANE = "test-bed"
# The lane's modules in an order that puts the users of one bed next to each other (node loss's; site; ssh;
# ray and the plain bed; mgmt), so that a bed is taken down soon after its last user (fixtures_testbed)
# instead of idling to the end of the session. The site's modules come after node loss's: by then the other
# worker has built the CPU image their site pushes (FIRST_BESIDE_THE_LANE), which a fresh machine (CI) takes
# minutes of a core to build, so that work is not on the lane that sets the suite's wall time.
# Modules not named here follow, in file order.
BED_LANE_ORDER = (
    "test_node_loss",
    "test_preemption_testbed",
    "test_watchdog_testbed",
    "test_ansible_docker",
    "test_testbed_site",
    "test_ansible",
    "test_cluster_ops",
    "test_testbed",
    "test_doctor",
    "test_failed_run_logs",
    "test_user_model_cluster",
    "test_doctor_skew",
    "test_kuberay_testbed",
    "test_multihost",
)
# The other worker starts with these: the image builds (the site's CPU image among them, under the image
# cache's lock) run while the lane trains on node loss's bed.
FIRST_BESIDE_THE_LANE = ("test_image_build",)
SLOW_TEST_WEIGHT = 60  # a slow test costs about a minute, a plain one about a second (what orders groups)
# The bed lane sets the suite's wall time, and on two cores the two workers' processes compete for the CPU.
# The other worker's tests (and every process they start) run at this lower priority, so the lane's
# processes get the cores when both want them and the rest of the suite uses what the lane leaves idle
# (its waits on rendezvous, probes and restarts). The image builds the lane waits for keep full priority.
BESIDE_THE_LANE_NICE = 5


@functools.lru_cache(maxsize=None)
def _uses_beds(module_path: str) -> bool:
    try:
        return bool(BED_USE.search(Path(module_path).read_text()))
    except OSError:
        return False


def group_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return BED_LANE if _uses_beds(str(REPO_ROOT / module)) else PurePath(module).stem


@pytest.hookimpl(optionalhook=True)  # pytest without xdist (the Python 3.9 side) has no such hook
def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker, in collection order (xdist's own reordering is off in pyproject.toml)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The bed lane first, then FIRST_BESIDE_THE_LANE, then the heaviest groups first, so that the longest never
    starts last (a module keeps its own order; the bed lane's modules go in BED_LANE_ORDER)."""
    weight: dict = {}
    for item in items:
        group = group_of(item.nodeid)
        weight[group] = weight.get(group, 0) + (SLOW_TEST_WEIGHT if item.get_closest_marker("slow") else 1)

    def order(group: str) -> tuple:
        return (group != BED_LANE, group not in FIRST_BESIDE_THE_LANE, -weight[group])

    rank = {group: i for i, group in enumerate(sorted(weight, key=order))}

    def place_in_group(item) -> int:
        stem = PurePath(item.nodeid.split("::", 1)[0]).stem
        return BED_LANE_ORDER.index(stem) if stem in BED_LANE_ORDER else len(BED_LANE_ORDER)

    items.sort(key=lambda item: (rank[group_of(item.nodeid)], place_in_group(item)))


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start processes, which inherit the priority
def pytest_runtest_setup(item):
    """Under xdist: a test-bed lane test (or one the lane waits for) at normal priority, any other lower."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    group = group_of(item.nodeid)
    nice = 0 if group == BED_LANE or group in FIRST_BESIDE_THE_LANE else BESIDE_THE_LANE_NICE
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except PermissionError:  # not root: the priority can only be lowered, never raised back
            pass


# What each xdist worker spent, printed at the end (CI's log included): the suite's wall time is set by the
# busier worker, and a fresh machine's (downloads, image builds, venvs) differs from a warm one's.
_WORKER_SECONDS: collections.Counter = collections.Counter()
_LANE_SECONDS: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    worker = getattr(getattr(report, "node", None), "gateway", None)
    if worker is None:  # not the xdist controller
        return
    _WORKER_SECONDS[worker.id] += report.duration
    _LANE_SECONDS["test-bed lane" if group_of(report.nodeid) == BED_LANE else "beside the lane"] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _WORKER_SECONDS:
        return
    workers = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in sorted(_WORKER_SECONDS.items()))
    lanes = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in sorted(_LANE_SECONDS.items()))
    terminalreporter.write_line(f"test time by worker: {workers}; by lane: {lanes}")
