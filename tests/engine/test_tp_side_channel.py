"""The tensor-parallel side channel (`TPDriver.post` -> a pipe per rank -> `_serve_side` -> `RankServer.side`), in
one process: rank 0's writer thread and a rank's reader thread over a real `multiprocessing` pipe. Only methods an
extension lists in ``SIDE_METHODS`` run; a call that raises, an unknown extension or an unreadable message does not
stop the reader; posts run in order; closing the pipe ends the reader."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from types import SimpleNamespace

from pd_cluster.engine.executor.tp import RankServer, TPDriver, _serve_side


class Recorder:
    SIDE_METHODS = frozenset({"note", "boom"})

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.done = threading.Event()

    def note(self, *args) -> None:
        self.calls.append(args)
        if args and args[0] == "last":
            self.done.set()

    def boom(self) -> None:
        raise RuntimeError("a posted call that fails")

    def unlisted(self, *args) -> None:  # not in SIDE_METHODS: must never run from the side channel
        self.calls.append(("unlisted",) + args)


def _driver(writer) -> TPDriver:
    """Rank 0's driver for one other rank, without starting it: only the side channel's parts."""
    d = TPDriver.__new__(TPDriver)
    d._side, d._posts = [writer], [queue.SimpleQueue()]
    d._posters = [threading.Thread(target=d._forward_posts, args=(1,), daemon=True)]
    d._posters[0].start()
    return d


def test_posted_calls_run_in_order_only_when_listed_and_survive_failures():
    reader, writer = mp.Pipe(duplex=False)
    ext = Recorder()
    server = RankServer(shard=None, tp=SimpleNamespace(rank=1), device=None)
    server.extensions["rec"] = ext
    rank = threading.Thread(target=_serve_side, args=(reader, server), daemon=True)
    rank.start()
    driver = _driver(writer)
    driver.post("rec", "note", 1, ("a", "b"))
    driver.post("rec", "boom")
    driver.post("rec", "unlisted", 2)
    driver.post("absent", "note", 3)
    driver.post("rec", "note", 4)
    assert ext.done.wait(0.01) is False
    driver._posts[0].put(None)  # the writer thread ends; then an unreadable message, written directly
    driver._posters[0].join(5)
    writer.send_bytes(b"not a pickle")
    writer.send(("rec", "note", ("last",)))
    assert ext.done.wait(10)
    assert ext.calls == [(1, ("a", "b")), (4,), ("last",)]
    writer.close()  # rank 0 closed the pipe (shutdown): the reader ends
    rank.join(5)
    assert not rank.is_alive()


def test_a_gone_rank_does_not_stop_the_writer():
    reader, writer = mp.Pipe(duplex=False)
    reader.close()  # the rank process is gone
    driver = _driver(writer)
    driver.post("rec", "note", 1)
    driver.post("rec", "note", 2)
    driver._posts[0].put(None)
    driver._posters[0].join(5)
    assert not driver._posters[0].is_alive()  # every post failed (broken pipe), logged, and the thread went on
