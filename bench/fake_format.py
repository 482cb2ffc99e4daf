"""OpenAI response bodies and errors of the fake server, pre-rendered per request (completions and chat)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from pd_cluster.bench.httpserver import Responder
from pd_cluster.common.openai_errors import openai_error_type

JSON = ("content-type", "application/json")


@dataclass(slots=True)
class Job:
    """One OpenAI request in flight on the fake."""

    rid: str
    chat: bool
    stream: bool
    include_usage: bool
    prompt_tokens: int
    n_tokens: int
    finish_reason: str
    pages: int = 0
    generated: int = 0


class ChunkFormat:
    """Pre-rendered pieces of the OpenAI response JSON for one request."""

    def __init__(self, job: Job, model: str) -> None:
        self.job = job
        created = int(time.time())
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        self._head = (f'data: {{"id":{json.dumps(job.rid)},"object":"{kind}","created":{created},'
                      f'"model":{json.dumps(model)},"choices":[')
        self._model = model
        self._created = created

    def _usage(self) -> dict[str, int]:
        j = self.job
        return {"prompt_tokens": j.prompt_tokens, "completion_tokens": j.n_tokens,
                "total_tokens": j.prompt_tokens + j.n_tokens}

    def role_chunk(self) -> bytes:
        if not self.job.chat:
            return b""
        body = '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}'
        return f"{self._head}{body}]}}\n\n".encode()

    def token_chunk(self, word: str) -> bytes:
        if self.job.chat:
            body = f'{{"index":0,"delta":{{"content":"{word}"}},"logprobs":null,"finish_reason":null}}'
        else:
            body = f'{{"index":0,"text":"{word}","logprobs":null,"finish_reason":null}}'
        return f"{self._head}{body}]}}\n\n".encode()

    def final_chunk(self) -> bytes:
        reason = self.job.finish_reason
        if self.job.chat:
            body = f'{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"{reason}"}}'
        else:
            body = f'{{"index":0,"text":"","logprobs":null,"finish_reason":"{reason}"}}'
        return f"{self._head}{body}]}}\n\n".encode()

    def usage_chunk(self) -> bytes:
        return f'{self._head}],"usage":{json.dumps(self._usage())}}}\n\n'.encode()

    def full_body(self, text: str) -> bytes:
        j = self.job
        if j.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": j.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": j.finish_reason}
        out = {"id": j.rid, "object": "chat.completion" if j.chat else "text_completion",
               "created": self._created, "model": self._model, "choices": [choice], "usage": self._usage()}
        return json.dumps(out).encode()


class ClientError(Exception):
    """A request the fake refuses: its HTTP status, message, the field it names and the error code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


async def send_json(resp: Responder, body: bytes) -> None:
    """A 200 with a JSON body."""
    resp.send(200, body, [JSON])


def send_error(resp: Responder, status: int, message: str, code: str, headers: list, param: str | None = None) -> None:
    """An OpenAI error body, typed as the workers type theirs (`openai_error_type`)."""
    body = {"error": {"message": message, "type": openai_error_type(status), "param": param, "code": code}}
    resp.send(status, json.dumps(body).encode(), headers + [JSON])
