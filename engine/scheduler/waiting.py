"""The waiting queue of the scheduler: requests not yet admitted, served round robin across client requests.

One client request can carry many sequences (a list of prompts, ``n`` > 1): a server fans it out into one engine
request per sequence, all of one *group* (`pd_cluster.engine.request.request_group`). First come, first served
over sequences would make a request sent just after a 1,000-prompt request wait for all of its prefills; here the
queue takes one sequence of each waiting group in turn (the group that just gave one goes to the back), so a
one-prompt request sent after a heavy one is admitted at the next admission, as if the heavy one were many
requests sent over time. Within a group the order is first come, first served. Retracted requests
(`appendleft`) come before every group: they already waited and held pages once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from pd_cluster.engine.request import Request


class WaitingQueue:
    """The deque operations the scheduler uses (`append`, `appendleft`, ``[0]``, `popleft`, `remove`, ``in``,
    ``len``, iteration), in round-robin order across groups."""

    def __init__(self) -> None:
        self._front: deque[Request] = deque()  # retracted, to be recomputed first
        self._groups: OrderedDict[str, deque[Request]] = OrderedDict()  # in turn order
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """In admission order as it stands: the retracted, then round robin over the groups."""
        yield from self._front
        queues = [list(q) for q in self._groups.values()]
        for i in range(max((len(q) for q in queues), default=0)):
            for q in queues:
                if i < len(q):
                    yield q[i]

    def __contains__(self, req: object) -> bool:
        if not isinstance(req, Request):
            return False
        q = self._groups.get(req.group)
        return req in self._front or (q is not None and req in q)

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("only the head of the waiting queue is addressable")
        if self._front:
            return self._front[0]
        for q in self._groups.values():
            return q[0]
        raise IndexError("the waiting queue is empty")

    def append(self, req: Request) -> None:
        """A new request: at the end of its group (a new group takes its turn after those waiting)."""
        q = self._groups.get(req.group)
        if q is None:
            q = self._groups[req.group] = deque()
        q.append(req)
        self._len += 1

    def appendleft(self, req: Request) -> None:
        """A retracted request: before everything else."""
        self._front.appendleft(req)
        self._len += 1

    def popleft(self) -> Request:
        """The head (`[0]`); its group goes to the back of the turn order."""
        if self._front:
            self._len -= 1
            return self._front.popleft()
        for group, q in self._groups.items():
            req = q.popleft()
            if q:
                self._groups.move_to_end(group)
            else:
                del self._groups[group]
            self._len -= 1
            return req
        raise IndexError("pop from an empty waiting queue")

    def remove(self, req: Request) -> None:
        """Take `req` out wherever it waits. Raises ``ValueError`` when it does not."""
        if req in self._front:
            self._front.remove(req)
        else:
            q = self._groups.get(req.group)
            if q is None:
                raise ValueError("request not in the waiting queue")
            q.remove(req)
            if not q:
                del self._groups[req.group]
        self._len -= 1
