"""One NIXL agent per worker (per TP rank), with the whole KV pool registered once.

The agent registers the pool's two regions at start-up (`KVPool.regions()`:
the page tensor, all layers' K and V of every page, and the FP8 scales), in
host memory (DRAM) or GPU memory (VRAM) by the same code: the memory type
follows the tensors' device. Two large regions, not one per page, keep
registration and metadata small whatever the pool size.

Its name carries a random incarnation id, so a restarted worker is a new
agent that no peer confuses with the old one (vllm #49238).

Two NIXL agents per worker: the data agent owns the registered pool and does
the WRITEs; a control agent (named ``<name>.ctl``, no memory) carries the
notifications and liveness probes. Measured here with UCX over TCP, a WRITE's
completion waits for the target to acknowledge every message still
outstanding on the same endpoint, i.e. for the peer's next `poll`; with the
messages on their own endpoint, a WRITE completes as soon as its bytes are
in the peer's memory.

All methods are meant for one thread, the worker's step loop, except
`connect`: it is the one call that blocks on the network (loading a peer's
metadata and setting up the connection, once per peer), so the workers run it
on another thread (`connects_off_thread`, `pd_cluster.transfer.http.aapply`).
For that, both NIXL agents run with NIXL's read-write thread synchronisation
(transfers share the lock, loading metadata takes it alone), connects are
serialised by a lock of their own, and the inbox of messages has a lock.
`send` may also come from the sender's heartbeat thread: every call into the
NIXL agents outside `connect` (post, check, release, send, progress) holds
one lock, so the two threads never drive a UCX worker at the same time; each
of these calls is short and non-blocking.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

import numpy as np

from pd_cluster.transfer import hugepages, protocol, ucx_env
from pd_cluster.transfer.config import TransferConfig
from pd_cluster.transfer.errors import NixlTransferError, PeerDiedError, PeerNotConnectedError
from pd_cluster.transfer.layout import AgentInfo, check_compatible, speculative_difference

logger = logging.getLogger(__name__)

DONE, PROC, ERR = "DONE", "PROC", "ERR"
CONTROL_SUFFIX = ".ctl"


def _load(agent, metadata: bytes, expected: str) -> None:
    """Load a remote agent's metadata; it must name `expected`.

    Raises:
        ValueError: the metadata names another agent (nothing stays loaded).
    """
    loaded = agent.add_remote_agent(metadata)
    loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
    if loaded != expected:
        agent.remove_remote_agent(loaded)
        raise ValueError(f"peer metadata names agent {loaded!r}, its info says {expected!r}")
    try:
        agent.make_connection(loaded)
    except Exception as e:  # the first transfer connects and reports the error itself
        logger.warning("KV transfer: early connection to %s failed: %r", loaded, e)


def _nixl_error(e: Exception, what: str, peer: str | None) -> Exception:
    """Map a NIXL binding exception to a typed transfer error."""
    if type(e).__name__ == "nixlRemoteDisconnectError":
        return PeerDiedError(f"{what}: peer agent {peer} disconnected ({e})", peer=peer)
    return NixlTransferError(f"{what}: {type(e).__name__}: {e}", peer=peer)


class TransferAgent:
    """The NIXL endpoint of one KV pool.

    Args:
        pool: the worker's `KVPool` (its `kv` and `scales` tensors are registered).
        model_identity: `LoadedModel.identity`, compared at the handshake.
        role: ``prefill``, ``decode`` or ``mixed`` (part of the agent name).
        config: transfer settings (UCX variables are exported before NIXL starts).
        speculative: the worker's speculative decoding as its peers see it (`AgentInfo.speculative`); None: off.

    Raises:
        ImportError: NIXL is not installed.
        RuntimeError: NIXL could not start its backend (e.g. a bad ``UCX_TLS``).
    """

    def __init__(self, pool, model_identity: str, role: str, config: TransferConfig,
                 speculative: dict | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.config = config
        self.pool = pool
        self.ucx = ucx_env.apply(config)
        self.incarnation = uuid.uuid4().hex[:12]
        layout = pool.layout
        host = socket.gethostname().replace("-", "_")
        self.name = f"{role}-{host}-{os.getpid()}-tp{layout.tp_rank}-{self.incarnation}"
        self._nixl = self._start(nixl_agent, nixl_agent_config, self.name)
        self._ctl = self._start(nixl_agent, nixl_agent_config, self.name + CONTROL_SUFFIX)
        kv, scales = pool.regions()
        self.page_nbytes = layout.page_nbytes  # bytes per page (all layers' K and V)
        self.mem_type = "DRAM" if kv.device.type == "cpu" else "VRAM"
        self.device_id = 0 if kv.device.index is None else int(kv.device.index)
        t0 = time.perf_counter()
        huge = hugepages.advise(kv) if config.hugepages else 0
        self._reg = self._nixl.register_memory([kv, scales])
        logger.info("KV transfer agent %s registered %s KV pool: %d pages x %d bytes (%.1f MiB, %.1f MiB moved to huge "
                    "pages) + scales in %.1f ms", self.name, self.mem_type, pool.num_pages, layout.page_nbytes,
                    kv.numel() * kv.element_size() / 2**20, huge / 2**20, (time.perf_counter() - t0) * 1e3)
        self.info = AgentInfo(
            agent_name=self.name, incarnation=self.incarnation, role=role, model_identity=model_identity,
            layout=layout.to_dict(), num_pages=pool.num_pages, mem_type=self.mem_type, device_id=self.device_id,
            kv_base=kv.data_ptr(), kv_nbytes=kv.numel() * kv.element_size(),
            scales_base=scales.data_ptr(), scales_nbytes=scales.numel() * scales.element_size(),
            nixl_metadata=self._nixl.get_agent_metadata(), control_metadata=self._ctl.get_agent_metadata(),
            speculative=dict(speculative or {}))
        self._peers: dict[str, AgentInfo] = {}
        self._inbox: list[tuple[str, protocol.Message]] = []
        self._inbox_lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._io_lock = threading.RLock()  # the step loop and the heartbeat thread (module doc)
        self._closed = False
        self.connect_threads: list[int] = []  # thread ids that ran a handshake (tests and diagnostics)

    @property
    def connects_off_thread(self) -> bool:
        """`connect` may run on another thread than the step loop's (see the module doc)."""
        return True

    def _start(self, nixl_agent, nixl_agent_config, name: str):
        c = self.config
        kwargs = {}
        try:  # transfers share NIXL's lock and a metadata load takes it alone, so `connect` may run off-thread
            from nixl._api import nixl_thread_sync_t
            kwargs["sync_mode"] = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
        except ImportError:  # an older NIXL without the option
            pass
        conf = nixl_agent_config(enable_prog_thread=c.enable_progress_thread, backends=[c.backend],
                                 num_threads=c.num_threads, **kwargs)
        try:
            agent = nixl_agent(name, conf)
        except Exception as e:  # nixlBackendError etc.
            raise RuntimeError(f"NIXL could not start backend {c.backend} (UCX_TLS={self.ucx['UCX_TLS']}, "
                               f"UCX_NET_DEVICES={self.ucx['UCX_NET_DEVICES']}): {e!r}") from e
        if c.backend not in agent.backends:
            raise RuntimeError(f"NIXL backend {c.backend} is not available (plugins: {agent.plugin_list})")
        return agent

    # ---- peers -------------------------------------------------------------

    def peer(self, name: str) -> AgentInfo:
        """The loaded info of peer `name`.

        Raises:
            PeerNotConnectedError: its metadata was never loaded (or was dropped).
        """
        try:
            return self._peers[name]
        except KeyError:
            raise PeerNotConnectedError(f"no metadata loaded for peer agent {name}; fetch it and connect first",
                                        peer=name) from None

    def is_connected(self, name: str) -> bool:
        return name in self._peers

    @property
    def peer_names(self) -> tuple[str, ...]:
        """The agents whose metadata is loaded (safe from any thread: a snapshot)."""
        return tuple(self._peers)

    def connect(self, info: AgentInfo) -> None:
        """The handshake: check the peer's layout, then load its NIXL metadata (once per incarnation).

        Blocks while NIXL sets up the connection; may run on any thread (one connect at a time).

        Raises:
            LayoutMismatchError: the layouts disagree (nothing is loaded).
            ValueError: the info names this agent, or its metadata names another agent.
        """
        if info.agent_name == self.name:
            raise ValueError(f"agent {self.name} cannot connect to itself")
        check_compatible(self.info, info)
        with self._connect_lock:
            if info.agent_name in self._peers:
                return
            if (differs := speculative_difference(self.info, info)) is not None:
                logger.info("%s", differs)
            self.connect_threads.append(threading.get_ident())
            t0 = time.perf_counter()
            _load(self._nixl, info.nixl_metadata, info.agent_name)
            try:
                _load(self._ctl, info.control_metadata, info.agent_name + CONTROL_SUFFIX)
            except Exception:
                self._nixl.remove_remote_agent(info.agent_name)
                raise
            try:  # start setting up the message connection now; the step loops' polls finish it
                with self._io_lock:
                    self._ctl.send_notif(info.agent_name + CONTROL_SUFFIX, protocol.encode(protocol.Ping()))
            except Exception as e:
                logger.info("KV transfer: first probe to %s failed: %r", info.agent_name, e)
            self._peers[info.agent_name] = info  # last: the step loop may use the peer from here on
        logger.info("KV transfer agent %s connected to peer %s (%s, %d pages) in %.1f ms", self.name,
                    info.agent_name, info.role, info.num_pages, (time.perf_counter() - t0) * 1e3)

    def disconnect(self, name: str) -> None:
        """Forget a peer (a stale incarnation): drop its metadata and its connection."""
        if self._peers.pop(name, None) is not None:
            for agent, remote in ((self._nixl, name), (self._ctl, name + CONTROL_SUFFIX)):
                try:
                    agent.remove_remote_agent(remote)
                except Exception as e:
                    logger.warning("KV transfer: removing peer %s: %r", remote, e)
            logger.info("KV transfer agent %s dropped peer %s", self.name, name)

    # ---- data --------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes = b""):
        """Post one WRITE of `local` descriptors into the peer's `remote` ones.

        Args:
            local, remote: [N, 3] uint64 ``(address, nbytes, device_id)`` rows (`pd_cluster.transfer.descriptors`).
            notif: if given, NIXL delivers it to the peer after the data; its completion then waits
                for the peer's progress (see `KVSender`, which notifies separately instead).

        Returns:
            ``(handle, state)`` with state ``DONE`` or ``PROC``.

        Raises:
            PeerNotConnectedError, PeerDiedError, NixlTransferError.
        """
        info = self.peer(peer)
        with self._io_lock:
            return self._write(peer, info, local, remote, notif)

    def _write(self, peer: str, info: AgentInfo, local: np.ndarray, remote: np.ndarray, notif: bytes):
        try:
            ldesc = self._nixl.get_xfer_descs(local, self.mem_type)
            rdesc = self._nixl.get_xfer_descs(remote, info.mem_type)
            handle = self._nixl.initialize_xfer("WRITE", ldesc, rdesc, peer, notif)
        except Exception as e:
            raise _nixl_error(e, "creating a KV transfer", peer) from e
        try:
            state = self._nixl.transfer(handle)
        except Exception as e:
            self.release(handle)
            raise _nixl_error(e, "posting a KV transfer", peer) from e
        if state == ERR:
            self.release(handle)
            raise NixlTransferError(f"NIXL refused to post a KV transfer to {peer}", peer=peer)
        return handle, state

    def check(self, handle, peer: str) -> str:
        """``DONE``, ``PROC`` or ``ERR`` (a disconnect raises instead).

        Raises:
            PeerDiedError: the peer disconnected.
        """
        try:
            with self._io_lock:
                return self._nixl.check_xfer_state(handle)
        except Exception as e:
            raise _nixl_error(e, "checking a KV transfer", peer) from e

    def release(self, handle) -> bool:
        """Release a transfer handle, cancelling it if still active. False if NIXL cannot cancel it yet."""
        try:
            with self._io_lock:
                handle.release()
            return True
        except Exception as e:
            logger.debug("KV transfer: release of %r deferred: %r", handle, e)
            return False

    # ---- notifications -----------------------------------------------------
    def send(self, peer: str, msg: protocol.Message, progress_data: bool = True) -> None:
        """Send a standalone notification.

        `progress_data` False progresses only the control agent (no memory registered): what the heartbeat
        thread uses, so it never progresses the data agent's WRITEs (on GPU, their completion belongs to the
        step loop's thread).

        Raises:
            PeerNotConnectedError, PeerDiedError, NixlTransferError.
        """
        self.peer(peer)
        with self._io_lock:
            if self._closed:
                raise PeerNotConnectedError(f"agent {self.name} is closed", peer=peer)
            try:
                self._ctl.send_notif(peer + CONTROL_SUFFIX, protocol.encode(msg))
            except Exception as e:
                raise _nixl_error(e, f"notifying {type(msg).__name__}", peer) from e
            self._pump(progress_data)  # progress once so the message leaves now, not at the next poll

    def take(self, *kinds: type) -> list[tuple[str, protocol.Message]]:
        """New messages of the given kinds, in arrival order, as ``(peer agent, message)``.

        Pings are dropped on arrival; messages of other kinds stay for their taker.
        """
        self._pump()
        keep, out = [], []
        with self._inbox_lock:
            for item in self._inbox:
                (out if isinstance(item[1], kinds) else keep).append(item)
            self._inbox = keep
        return out

    def _pump(self, data: bool = True) -> None:
        with self._io_lock:
            if data:  # progresses the data endpoint (a TCP-only WRITE needs the target's progress)
                self._nixl.get_new_notifs()
            notifs = self._ctl.get_new_notifs()
        for peer, raws in notifs.items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            peer = peer.removesuffix(CONTROL_SUFFIX)
            for raw in raws:
                try:
                    msg = protocol.decode(raw)
                except ValueError as e:
                    logger.warning("KV transfer: dropped a notification from %s: %s", peer, e)
                    continue
                if not isinstance(msg, protocol.Ping):
                    with self._inbox_lock:
                        self._inbox.append((peer, msg))

    # ---- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Drop all peers and deregister the pool. Call only when no transfer is in flight."""
        if self._closed:
            return
        with self._io_lock:  # a heartbeat in flight ends first; later ones find no peer
            self._closed = True
        for name in list(self._peers):
            self.disconnect(name)
        try:
            self._nixl.deregister_memory(self._reg)
        except Exception as e:
            logger.warning("KV transfer: deregistering the pool: %r", e)
