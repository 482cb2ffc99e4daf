"""Where the cluster-wide KV store keeps pages: Mooncake Store (``mooncake``) or a directory (``file``).

Both answer the same four calls, in batches of keys, from the tier's I/O threads (never the engine thread):
`exists`, `get`, `put` and `remove`. A backend that cannot reach its store raises `StoreUnavailable`; the tier
then serves without it and calls `reconnect` until it answers again (`pd_cluster.engine.kv.l3.tier`).

- `MooncakeBackend`: a ``MooncakeDistributedStore`` client (``mooncake-transfer-engine``; the
  ``-non-cuda`` build runs on CPU) set up with SGLang's settings: the master's address, the transfer engine's
  metadata server, the protocol (``tcp`` on one host, ``rdma`` on clusters) and its devices, the memory this
  process contributes to the store (``global_segment_size``; 0 by default, so a worker that dies takes no page
  with it: a store service or ``pd-serve``'s own holds them) and its local transfer buffer
  (``local_buffer_size``). Values are bytes (`keys.encode_page`); Mooncake keeps each under its key until its
  own eviction drops it.
- `FileBackend`: one file per page under a directory, local or shared (NFS, a PVC): ``<dir>/<key>``, written to
  a temporary name and renamed, so a reader sees a whole file or none. The directory is never pruned by the
  engine: give it a volume of its own, or clear it when the model changes.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger("engine")


class StoreUnavailable(RuntimeError):
    """The store cannot be reached (or refused the call as a whole)."""


class StorageBackend(Protocol):
    """A key-value store of encoded pages."""

    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored. Raises `StoreUnavailable`."""

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value, None where absent. Raises `StoreUnavailable`."""

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Store values (a key already stored keeps its value); returns how many are stored now. Raises
        `StoreUnavailable`."""

    def remove(self, key: str) -> None:
        """Forget a key (a page found bad); absent keys are fine."""

    def reconnect(self) -> None:
        """Try to reach the store again. Raises `StoreUnavailable`."""

    def ping(self) -> None:
        """A cheap check, every few seconds while the store is in use, that it still answers (a worker that sends
        it nothing learns that it went away). Raises `StoreUnavailable`."""

    def close(self) -> None:
        """Let go of the store."""


class FileBackend:
    """Pages as files under `root` (module docstring); `reconnect` checks that it can write there."""

    name = "file"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def reconnect(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe-"):
                pass
        except OSError as e:
            raise StoreUnavailable(f"the KV store directory {self.root} is not writable: {e}") from e

    def ping(self) -> None:
        if not (self.root.is_dir() and os.access(self.root, os.W_OK)):
            raise StoreUnavailable(f"the KV store directory {self.root} is gone or not writable")

    def _path(self, key: str) -> Path:
        head, _, digest = key.rpartition("/")
        return self.root / head / digest[:2] / digest

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self._path(k).is_file() for k in keys]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            try:
                out.append(self._path(k).read_bytes())
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise StoreUnavailable(f"reading {self._path(k)}: {e}") from e
        return out

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        stored = 0
        for key, value in items:
            path = self._path(key)
            if path.is_file():
                stored += 1
                continue
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                os.replace(tmp, path)
                stored += 1
            except OSError as e:
                raise StoreUnavailable(f"writing {path}: {e}") from e
        return stored

    def remove(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except OSError:
            pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class MooncakeSettings:
    """A Mooncake Store client's settings (SGLang's names; ``docs/kv-store.md``)."""

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 64 * 1024 * 1024


class MooncakeBackend:
    """A ``MooncakeDistributedStore`` client (module docstring); `reconnect` sets it up (raises
    `StoreUnavailable` when the package is missing or the master cannot be reached)."""

    name = "mooncake"

    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        self._store = None

    def reconnect(self) -> None:
        """Connect, or check that the client reaches its master again (a Mooncake client finds a restarted
        master by itself; a client that never connected is set up here). The master's port is tried first:
        Mooncake's own setup retries for about 90 s before it gives up on a master that is not there."""
        if self._store is not None:
            if self._store.is_exist(PROBE_KEY) < 0:
                raise StoreUnavailable(f"Mooncake master {self.settings.master_server_address} does not answer")
            return
        s = self.settings
        host, _, port = s.master_server_address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=2.0).close()
        except (OSError, ValueError) as e:
            raise StoreUnavailable(f"cannot connect to the Mooncake master at {s.master_server_address}: {e}") from e
        # Mooncake's client logs every call at INFO, and errors the tier reports itself (a master that is gone)
        # once a second: its fatal errors only, unless the operator sets the level
        os.environ.setdefault("GLOG_minloglevel", "3")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StoreUnavailable(f"--hicache-storage-backend mooncake needs the mooncake-transfer-engine package "
                                   f"(pip install 'pd-cluster[mooncake]'; on Debian also apt-get install "
                                   f"libibverbs1): {e}") from e
        store = MooncakeDistributedStore()
        try:
            rc = store.setup(s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
                             s.protocol, s.device_name, s.master_server_address)
        except Exception as e:  # noqa: BLE001 - the binding raises plain RuntimeErrors
            raise StoreUnavailable(f"Mooncake master {s.master_server_address}: {e}") from e
        if rc != 0:
            raise StoreUnavailable(f"Mooncake master {s.master_server_address} refused the client (setup "
                                   f"returned {rc})")
        self._store = store

    def ping(self) -> None:
        if self._client().is_exist(PROBE_KEY) < 0:
            raise StoreUnavailable(f"Mooncake master {self.settings.master_server_address} does not answer")

    def _client(self):
        if self._store is None:
            raise StoreUnavailable("not connected to the Mooncake master")
        return self._store

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._client().batch_is_exist(list(keys))
        if any(c < 0 for c in codes):
            raise StoreUnavailable(f"Mooncake is_exist failed ({min(codes)})")
        return [c == 1 for c in codes]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._client().get_batch(list(keys))
        return [bytes(v) if v else None for v in values]

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        if not items:
            return 0
        client = self._client()
        stored = 0
        for key, value in items:
            rc = client.put(key, value)
            if rc == 0 or rc == OBJECT_ALREADY_EXISTS:
                stored += 1
            elif rc in UNREACHABLE_CODES:
                raise StoreUnavailable(f"Mooncake put failed ({rc})")
        return stored

    def remove(self, key: str) -> None:
        if self._store is not None:
            self._store.remove(key, True)  # force: a page just read is under its read lease

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - closing a client whose master is gone
                logger.debug("closing the Mooncake client failed", exc_info=True)


PROBE_KEY = "pdkv-probe"
OBJECT_ALREADY_EXISTS = -705
"""Mooncake's ``ErrorCode::OBJECT_ALREADY_EXISTS``: another worker stored the page first (it is stored)."""
UNREACHABLE_CODES = frozenset({-1, -800, -900, -1000, -1001, -1002, -1003, -1010, -1011})
"""Mooncake's internal, transfer, RPC and high-availability failures: the store is unreachable. Other codes (such
as ``NO_AVAILABLE_HANDLE``, -200: no room) leave that one page unstored."""
