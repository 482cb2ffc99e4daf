"""``pd-serve --prefill-ports/--decode-ports/--mixed-ports``: the workers listen where they are told (the cluster is
built, not started: no process)."""

from __future__ import annotations

import pytest

from pd_cluster.launch.cluster import LocalCluster
from pd_cluster.launch.cluster_spec import ClusterSpec, worker_ports
from pd_cluster.launch.serve import build_parser, main, parse_port_list


def test_the_flags_parse_lists_and_ranges():
    args = build_parser().parse_args(["--prefill-ports", "31001", "--decode-ports", "31010-31011",
                                      "--mixed-ports", "31020,31022-31023"])
    assert (args.prefill_ports, args.decode_ports, args.mixed_ports) == ("31001", "31010-31011", "31020,31022-31023")
    assert parse_port_list("31020,31022-31023", "--mixed-ports") == (31020, 31022, 31023)
    for bad in ("x", "31002-31001", "31001,"):
        with pytest.raises(ValueError, match="--decode-ports"):
            parse_port_list(bad, "--decode-ports")


def test_the_workers_of_a_cluster_get_the_ports_in_order():
    cluster = LocalCluster(ClusterSpec(num_prefill=1, num_decode=2, router_port=31000,
                                       role_ports={"prefill": (31001,), "decode": (31010, 31011)}))
    urls = {p.name: p.url for p in cluster.procs}
    assert urls == {"prefill-0": "http://127.0.0.1:31001", "decode-0": "http://127.0.0.1:31010",
                    "decode-1": "http://127.0.0.1:31011"}
    router_argv = cluster.router.argv
    assert router_argv[router_argv.index("--prefill") + 1] == "http://127.0.0.1:31001"
    # a role without ports still gets free ones
    free = LocalCluster(ClusterSpec(num_prefill=1, num_decode=1, role_ports={"decode": (31010,)}))
    assert {p.name: p.url.endswith(":31010") for p in free.procs} == {"prefill-0": False, "decode-0": True}


@pytest.mark.parametrize("ports, router, message", [
    ({"decode": (31010,)}, 31000, "1 port"),  # two decode workers
    ({"prefill": (31001,), "decode": (31001, 31002)}, 31000, "differ"),
    ({"prefill": (31000,), "decode": (31001, 31002)}, 31000, "router"),
    ({"prefill": (70000,), "decode": (31001, 31002)}, 31000, "not a TCP port"),
])
def test_ports_that_do_not_fit_are_refused(ports, router, message):
    workers = [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]
    with pytest.raises(ValueError, match=message):
        worker_ports(workers, ports, router)


def test_pd_serve_refuses_a_port_list_of_the_wrong_length(capsys):
    with pytest.raises(SystemExit):
        main(["--num-decode", "2", "--decode-ports", "31010", "--startup-timeout", "1"])
    assert "--decode-ports: 1 port(s) for 2 decode worker(s)" in capsys.readouterr().err
