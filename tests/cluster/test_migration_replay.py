"""Migration of streams whose continuation depends on the output so far, on a real 1P2D cluster.

Each stream below is one the router could not continue from a bare ``prompt + generated ids`` prompt: a
regex or JSON-schema grammar (the matcher must replay what was generated), a named tool call, presence and
frequency penalties (they count output tokens only), logprobs (offsets continue), seeded sampling (the
generator's draws). All start on one decode (the other is taken out of the router); once every stream has
relayed a token that decode is frozen (SIGSTOP), the other is added back, and the frozen one is killed
(SIGKILL), so every stream still running migrates. Every stream must equal the undisturbed run exactly, seen
through the real ``openai`` client, the router's log must show each one's migration (by its ``x-request-id``),
and every page must return. A round in which a stream ended before the freeze (a loaded machine can let the
first stream run ahead while the last is in prefill) is exact too, and is run again the other way round.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import jsonschema
import openai
import pytest
from cluster_util import running_cluster, wait_all_free

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

STORY = "Once upon a time, there was a little dog named Max who"
REGEX = "[a-z ]{300}"
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 20},
    "story": {"type": "string", "minLength": 240, "maxLength": 260},
    "mood": {"enum": ["happy", "sad", "brave"]}},
    "required": ["title", "story", "mood"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "tell", "description": "Tell a story.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 240, "maxLength": 250}},
    "required": ["text"], "additionalProperties": False}}}
USER = [{"role": "user", "content": STORY}]

CASES = {
    "regex": ("completion", dict(prompt=STORY, max_tokens=400, temperature=0.0,
                                 extra_body={"guided_regex": REGEX})),
    "json_schema": ("chat", dict(messages=USER, max_tokens=400, temperature=1.0, seed=9, response_format={
        "type": "json_schema", "json_schema": {"name": "tale", "schema": SCHEMA}})),
    "tool_named": ("chat", dict(messages=USER, max_tokens=400, temperature=0.0, tools=[TOOL],
                                tool_choice={"type": "function", "function": {"name": "tell"}})),
    "penalties": ("completion", dict(prompt=STORY, max_tokens=200, temperature=0.0, presence_penalty=1.0,
                                     frequency_penalty=0.5, extra_body={"ignore_eos": True})),
    "logprobs": ("completion", dict(prompt=STORY, max_tokens=200, temperature=0.0, logprobs=2,
                                    extra_body={"ignore_eos": True})),
    "seeded_chat": ("chat", dict(messages=USER, max_tokens=200, temperature=1.0, seed=123, logprobs=True,
                                 top_logprobs=1, extra_body={"ignore_eos": True})),
}


async def _run(client: openai.AsyncOpenAI, name: str, progress: dict, tag: str) -> dict:
    kind, kw = CASES[name]
    make = client.completions.create if kind == "completion" else client.chat.completions.create
    stream = await make(model="stories260K", stream=True, extra_headers={"x-request-id": f"{tag}-{name}"}, **kw)
    out = {"text": "", "args": "", "tokens": [], "offsets": [], "finish": None, "ids": set()}
    started = time.monotonic()
    progress[id(out)] = 0
    async for chunk in stream:
        out["ids"].add(chunk.id)
        for c in chunk.choices:
            out["finish"] = c.finish_reason or out["finish"]
            if kind == "completion":
                out["text"] += c.text
                if c.logprobs is not None:
                    out["tokens"] += c.logprobs.tokens
                    out["offsets"] += c.logprobs.text_offset
            else:
                out["text"] += c.delta.content or ""
                for call in c.delta.tool_calls or ():
                    out["args"] += call.function.arguments or ""
                if c.logprobs is not None and c.logprobs.content:
                    out["tokens"] += [t.token for t in c.logprobs.content]
            progress[id(out)] += 1
    out["seconds"] = time.monotonic() - started
    return out


async def _all(url: str, names: list[str], tag: str, faults=()) -> list[dict]:
    """Start one stream per name, 30 ms apart, with request ids ``{tag}-{name}``; once every stream has 2
    chunks, call each of `faults` in turn. Returns each stream's result."""
    progress: dict = {}
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", timeout=180, max_retries=0) as client:
        tasks = []
        for name in names:
            tasks.append(asyncio.ensure_future(_run(client, name, progress, tag)))
            await asyncio.sleep(0.03)
        if faults:
            deadline = time.monotonic() + 60
            while (len(progress) < len(names) or min(progress.values()) < 2) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            for fault in faults:
                await asyncio.to_thread(fault)
        return await asyncio.gather(*tasks)


def _migrated(cluster, tag: str) -> set[str]:
    """The names of the streams of round `tag` that the router's log shows migrating."""
    names = set()
    for line in list(cluster.logs.get(cluster.router.name, ())):
        if "migrating request" not in line:
            continue
        try:
            rid = json.loads(line).get("request_id", "")
        except ValueError:
            continue
        if rid.startswith(tag + "-"):
            names.add(rid[len(tag) + 1:])
    return names


def _check_valid(name: str, out: dict) -> None:
    if name == "regex":
        assert re.fullmatch(REGEX, out["text"]), out["text"]
    elif name == "json_schema":
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    elif name == "tool_named":
        assert out["finish"] == "tool_calls" and out["text"] == ""
        jsonschema.validate(json.loads(out["args"]), TOOL["function"]["parameters"])
    elif name == "logprobs":
        assert "".join(out["tokens"]) == out["text"]
        assert all(out["text"][o:].startswith(t) for o, t in zip(out["offsets"], out["tokens"]))


def migrate_every_stream(cluster, names: list[str], reference: list[dict]) -> str:
    """Run `names` on one decode of a 1P2D `cluster`, freeze it once every stream relayed a token, add the other
    back, kill the frozen one; assert every stream equals `reference` and that the router's log shows each one
    migrating. A round in which a stream ended before the freeze is run again the other way round (at most 3).
    Returns the URL of the decode the streams moved to."""
    admin = httpx.Client(base_url=cluster.router_url, timeout=10)
    serving, spare = "decode-0", "decode-1"
    for attempt in range(3):
        tag = f"round{attempt}"
        spare_url = cluster.by_name(spare).url
        assert admin.delete("/workers", params={"url": spare_url}).status_code == 200
        frozen = cluster.by_name(serving).pid
        faults = (lambda pid=frozen: os.killpg(pid, signal.SIGSTOP),
                  lambda url=spare_url: admin.post("/workers", json={"url": url, "role": "decode"}
                                                   ).raise_for_status(),
                  lambda name=serving: cluster.kill(name))
        got = asyncio.run(_all(cluster.router_url, names, tag, faults))
        for name, out, ref in zip(names, got, reference):
            _check_valid(name, out)
            for key in ("text", "args", "tokens", "offsets", "finish"):
                assert out[key] == ref[key], (name, key)
            assert len(out["ids"]) == 1  # one stream id, migrated or not
        migrated = _migrated(cluster, tag)
        if migrated == set(names):
            return spare_url
        assert migrated < set(names), migrated
        cluster.restart(serving)
        cluster.wait_ready(timeout=120)
        serving, spare = spare, serving
    raise AssertionError(f"3 rounds had a stream end before the freeze; the last migrated only {migrated}")


def test_streams_that_replay_their_output_migrate_exactly():
    names = list(CASES)
    with running_cluster(1, 2, router_argv=["--upstream-idle-timeout-secs", "5",
                                            "--request-timeout-secs", "240"]) as cluster:
        reference = asyncio.run(_all(cluster.router_url, names, "reference"))
        for name, ref in zip(names, reference):
            _check_valid(name, ref)
        migrate_every_stream(cluster, names, reference)
        loads = wait_all_free(cluster, timeout=30)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
