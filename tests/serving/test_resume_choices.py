"""``resume_token_ids`` with several choices on a real (in-process) worker: one list per choice, ``null`` for a
choice that already finished. A continuation cut at any point of each choice gives, appended to what was
delivered, the undisturbed stream of every choice (greedy two-prompt streams, seeded ``n`` = 2 streams: choice
``j`` keeps its seed + j), and a finished choice is not generated again.
"""

from __future__ import annotations

import json

import httpx
import pytest
from worker_kit import running_worker


@pytest.fixture(scope="module")
def worker():
    with running_worker() as w:
        yield w


def _stream(client: httpx.Client, body: dict) -> dict[int, dict]:
    """Each choice's text, token ids and finish reason from a streamed completion."""
    out: dict[int, dict] = {}
    with client.stream("POST", "/v1/completions", json=dict(body, stream=True, return_token_ids=True)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                got = out.setdefault(c["index"], {"text": "", "ids": [], "finish": None})
                got["text"] += c["text"]
                got["ids"] += c.get("token_ids") or []
                got["finish"] = c["finish_reason"] or got["finish"]
    return out


@pytest.mark.parametrize("body", [
    {"prompt": ["Once upon a time", "The little dog ran to the park and"], "max_tokens": 12, "temperature": 0},
    {"prompt": "Lily wanted to bake a cake", "n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 7},
], ids=["two-prompts", "n-2-seeded"])
def test_each_choice_continues_exactly_and_a_finished_one_is_not_generated_again(worker, body):
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        ref = _stream(c, dict(body, ignore_eos=True))
        assert set(ref) == {0, 1} and all(len(ref[i]["ids"]) == 12 for i in (0, 1))
        assert ref[0]["text"] != ref[1]["text"]
        for cut in (1, 5, 11):
            resumed = [ref[0]["ids"][:cut], None]  # choice 1 already finished: not sent again
            cont = _stream(c, dict(body, ignore_eos=True, resume_token_ids=resumed))
            assert set(cont) == {0}, cont
            assert cont[0]["ids"] == ref[0]["ids"][cut:] and cont[0]["finish"] == "length"
            assert cont[0]["text"] and ref[0]["text"].endswith(cont[0]["text"])
            both = _stream(c, dict(body, ignore_eos=True, resume_token_ids=[ref[0]["ids"][:cut],
                                                                            ref[1]["ids"][:12 - cut]]))
            assert both[0]["ids"] == ref[0]["ids"][cut:] and both[1]["ids"] == ref[1]["ids"][12 - cut:]
        r = c.post("/v1/completions", json=dict(body, stream=True, resume_token_ids=[[1]]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "resume_token_ids"
        r = c.post("/v1/completions", json=dict(body, stream=True, resume_token_ids=[None, None]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "resume_token_ids"
