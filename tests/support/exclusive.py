"""The test modules that need the machine to themselves: the ``exclusive`` marker.

A run of the suite split over processes (pytest-xdist: ``-n 2 --dist loadfile -m "not exclusive"``) leaves these
modules out, to run them alone afterwards (``-m exclusive``); CI's command (the README's) runs the suite so. A module
belongs here when what it checks is a window of wall-clock time that a second test process on a 2-core machine
would eat into: a freeze that must outlast one deadline and not another, CPU hogs that are the load under test, a
budget or a rate measured against the clock, fault injection under load where a slow peer must not read as a dead
one. A module that only checks outputs (exact tokens, pages freed, error bodies) does not, however slow it is.

`tests/conftest.py` marks every test of these modules; `tests/layout/test_test_tiers.py` checks that each path
exists.
"""

from __future__ import annotations

EXCLUSIVE_MODULES: dict[str, str] = {
    # freezes and deadlines
    "tests/cluster/test_long_freeze.py": "a 42 s and a 24 s freeze against a 15 s transfer deadline",
    "tests/cluster/test_overload_freeze.py": "SIGSTOP of a decode shorter and longer than the request deadline",
    "tests/cluster/test_migration.py": "a frozen decode fails fast, within a bound",
    "tests/cluster/test_dead_prefill.py": "a prefill chunk that outlasts the KV timeout keeps every rank alive",
    "tests/transfer/test_transfer_failures.py": "SIGSTOP against the transfer deadline, between two processes",
    "tests/router/test_router_migration.py": "SIGKILL and SIGSTOP of fake decode workers mid-stream, with timeouts",
    "tests/router/test_router_blame.py": "a frozen decode must not open the prefill's breaker",
    "tests/router/test_router_resilience.py": "retries, upstream timeouts and disconnects, timed",
    "tests/router/test_router_lifecycle.py": "graceful shutdown and idle connections, timed",
    # load is what the test measures
    "tests/cluster/test_overload_cold_start.py": "CPU hogs on the machine's own cores are the load",
    "tests/cluster/test_soak_script.py": "30 s of load with a SIGKILL",
    "tests/cluster/test_router_cluster.py": "kill and restart of workers under load",
    "tests/cluster/test_bad_input_under_load.py": "every bad request answered within 2 s beside 8 streams",
    "tests/cluster/test_cluster_load.py": "load leaves no trace: disconnects under load",
    "tests/cluster/test_autoscale.py": "the planner decides from measured latencies of a burst",
    # the clock is the subject
    "tests/bench/test_first_contact_script.py": "a step stopped at its share of a 16 s budget",
    "tests/bench/test_arrivals.py": "send times of a Poisson process at 50 per second",
    "tests/bench/test_exact_metrics.py": "reported latencies against a fake server's delays",
}
