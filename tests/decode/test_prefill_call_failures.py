"""How the decode worker reads a failed ``/prefill`` call: a fact of death apart from everything else.

A real decode-role engine in its `EngineLoop`, a scripted receiver, and on loopback either nothing (a refused
connection), a scripted prefill worker answering 500, or a server that reads the job and closes the connection.
Only a refused (or reset) connection is the prefill worker's death (``prefill_unreachable``, every transfer from
it failed at once); one closed connection or its internal error fails this request alone, with a code the router
blames on nobody (``prefill_connection_lost``, ``prefill_error``) rather than on the decode worker.
"""

from __future__ import annotations

import asyncio

import pytest
from scripted import FakePrefill
from test_remote_prefill import PROMPT_IDS, _run

from pd_cluster.common.net import free_port
from pd_cluster.engine.sampling.params import SamplingParams


async def _failure(source, rid: str):
    with pytest.raises(Exception) as e:
        await asyncio.wait_for(source.start(rid, PROMPT_IDS, SamplingParams(max_tokens=4), {}), 20)
    return e.value


def test_a_refused_prefill_connection_is_death_and_fails_its_transfers():
    async def body(engine, hooks, loop, source):
        err = await _failure(source, "refused")
        assert (err.status, err.code) == (502, "prefill_unreachable")
        await asyncio.sleep(0.2)  # the failure reaches the engine thread
        assert "peer_failed" in hooks.receiver.kinds()  # every transfer from the gone worker fails now
        assert hooks.get("refused").state.value == "quarantined"  # until the receiver confirms the sender gone

    _run(f"http://127.0.0.1:{free_port()}", body)


def test_a_prefill_internal_error_is_not_blamed_on_the_decode():
    prefill = FakePrefill()
    prefill.mode = "500"  # answers {"code": "internal_error"}, which the router would blame on this decode worker
    try:
        async def body(engine, hooks, loop, source):
            err = await _failure(source, "p500")
            assert (err.status, err.code) == (502, "prefill_error")
            await asyncio.sleep(0.2)
            assert "peer_failed" not in hooks.receiver.kinds()

        _run(prefill.url, body)
    finally:
        prefill.stop()


def test_one_closed_prefill_connection_fails_that_request_alone():
    async def closer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the job's headers arrived; then the connection closes, unanswered
        writer.close()

    async def body(engine, hooks, loop, source):
        port = free_port()
        server = await asyncio.start_server(closer, "127.0.0.1", port)
        source.default_prefill_url = f"http://127.0.0.1:{port}"
        try:
            err = await _failure(source, "closed")
        finally:
            server.close()
        assert (err.status, err.code) == (502, "prefill_connection_lost")
        await asyncio.sleep(0.2)
        assert "peer_failed" not in hooks.receiver.kinds() and "abort" in hooks.receiver.kinds()

    _run("http://127.0.0.1:1", body)
