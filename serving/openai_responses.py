"""``POST /v1/responses``: OpenAI's Responses API on a decode or mixed worker, served by the chat path.

The request becomes the chat-completions request it means (``common/responses_input.py``: ``instructions`` and
``input`` as messages, function tools, ``text.format`` as ``response_format``, ``max_output_tokens``...; a field
that is not honoured is refused with a 400 naming it, and nothing is stored), which goes through the same
validation, chat template, tokenization, structured outputs and tool calls as ``/v1/chat/completions``
(`OpenAIServing.prepare_data`), so its greedy text is the chat answer's. The answer is a ``response`` object whose
``output`` holds an assistant ``message`` (one ``output_text`` part) and/or ``function_call`` items; a response cut
by ``max_output_tokens`` is ``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``).

Streamed (``stream: true``), the events are OpenAI's, each with its ``sequence_number`` and as an SSE ``event:``
line plus a ``data:`` line: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for a message ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``, and for a function call
``response.function_call_arguments.delta`` ..., ``response.function_call_arguments.done``; then
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``, or ``response.failed`` if
the engine fails the request) with the whole response. Calls stream as the chat path streams them
(`pd_cluster.serving.tools.stream.ToolCallStream`), and the final response holds exactly what was streamed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pd_cluster.common.responses_input import Refused, to_chat
from pd_cluster.serving.body import parse_json_object, read_body
from pd_cluster.serving.choices import ChoiceRun, raise_error, request_error, until_disconnect
from pd_cluster.serving.errors import HTTPError, error_response, to_http_error
from pd_cluster.serving.metrics import RequestTiming

logger = logging.getLogger("pd.serving")

# chat fields a validation error may name -> the Responses field the client sent
_PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


class ResponsesServing:
    """The ``/v1/responses`` handler over a worker's `OpenAIServing` (``serving``)."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving

    async def create(self, request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        arrival = time.monotonic()
        serving = self.serving
        try:
            raw = await read_body(request)
            data, prep = await serving.tok.run(self._prepare, raw)
            runs = serving.make_runs(prep, "chat", request_id)
            await serving.start_runs(request, prep, runs)
        except asyncio.CancelledError:  # the client went away before the first token (already aborted)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            err = to_http_error(e)
            if err.param is not None:
                head = err.param.split("[")[0].split(".")[0]
                err.param = _PARAMS.get(head, head) if head in _PARAMS else err.param
            if err.status >= 500:
                logger.warning("request %s failed before the first token: %s %s", request_id, err.status, err.message)
            return error_response(err, request_id)
        (run, params, _, _), = runs
        out = ResponseObject(data, request_id, serving.model_name)
        timing = RequestTiming(serving.metrics, arrival, params.max_tokens)
        headers = {"X-Request-Id": request_id}
        if data.get("stream"):
            return StreamingResponse(self._stream(run, out, timing, prep.tools), media_type="text/event-stream",
                                     headers=headers)
        return await self._whole(request, run, out, timing, headers)

    def _prepare(self, raw: bytes) -> tuple[dict[str, Any], Any]:
        data = parse_json_object(raw)
        try:
            chat = to_chat(data)
        except Refused as e:
            raise HTTPError(400, str(e), e.param, e.code) from None
        return data, self.serving.prepare_data(chat, "chat")

    # ---- one JSON body ----------------------------------------------------------------------------------------
    async def _whole(self, request: Request, run: ChoiceRun, out: "ResponseObject", timing: RequestTiming,
                     headers: dict[str, str]) -> Response:
        d = run.first
        try:
            while True:
                timing.on_delta(d)
                run.builder.add(d)
                if (failed := request_error(d)) is not None:
                    return JSONResponse(failed.body(), status_code=failed.status, headers=headers)
                if d.finished:
                    run.finished = True
                    break
                d = raise_error(await until_disconnect(request, asyncio.ensure_future(run.stream.get())))
        except Exception as e:  # noqa: BLE001 - the engine died: an OpenAI error body
            err = to_http_error(e)
            return JSONResponse(err.body(), status_code=err.status, headers=headers)
        finally:
            if not run.finished:
                self.serving.source.abort(run.engine_id)
        timing.on_finish(run.builder.finish_reason, d)
        message = run.builder.full()["choices"][0]["message"]
        items = []
        if message.get("content") or not message.get("tool_calls"):
            items.append(out.message(message.get("content") or "", "completed"))
        for call in message.get("tool_calls") or ():
            items.append(out.function_call(call["id"], call["function"]["name"], call["function"]["arguments"],
                                           "completed"))
        items[-1]["status"] = out.item_status(run.builder.finish_reason)  # the item a cut output ended in
        return JSONResponse(out.body(run.builder, items), headers=headers)

    # ---- events ----------------------------------------------------------------------------------------------
    async def _stream(self, run: ChoiceRun, out: "ResponseObject", timing: RequestTiming,
                      tools: Any) -> AsyncIterator[bytes]:
        events = EventWriter(out)
        calls = tools.stream() if tools is not None else None
        yield events.emit("response.created", response=out.body(None, [], "in_progress"))
        yield events.emit("response.in_progress", response=out.body(None, [], "in_progress"))
        d: Any = run.first
        try:
            while True:
                if isinstance(d, BaseException):
                    raise d
                timing.on_delta(d)
                run.builder.add(d)
                if (failed := request_error(d)) is not None:
                    yield events.emit("response.failed", response=out.body(run.builder, events.items, "failed",
                                                                            failed.body()["error"]))
                    return
                deltas = (calls.feed(d.new_text) if calls is not None else
                          [{"content": d.new_text}] if d.new_text else [])
                if d.finished:
                    deltas += calls.finish() if calls is not None else []
                for delta in deltas:
                    for chunk in events.delta(delta):
                        yield chunk
                if d.finished:
                    run.finished = True
                    break
                d = await run.stream.get()
            timing.on_finish(run.builder.finish_reason, d)
            for chunk in events.close(out.item_status(run.builder.finish_reason)):
                yield chunk
            body = out.body(run.builder, events.items)
            yield events.emit("response.completed" if body["status"] == "completed" else "response.incomplete",
                              response=body)
        except Exception as e:  # noqa: BLE001 - the engine died mid-stream: the response failed
            err = to_http_error(e)
            logger.warning("request %s failed mid-stream: %s", run.engine_id, err.message)
            yield events.emit("response.failed", response=out.body(run.builder, events.items, "failed",
                                                                    err.body()["error"]))
        finally:
            if not run.finished:
                self.serving.source.abort(run.engine_id)


class ResponseObject:
    """The ``response`` object of one request: the request's echoed settings, ids, output items, usage."""

    def __init__(self, data: dict[str, Any], request_id: str, model: str) -> None:
        self.data = data
        self.id = "resp_" + request_id
        self.message_id = "msg_" + request_id
        self.model = model
        self.created_at = int(time.time())

    @staticmethod
    def item_status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [output_text(text)]}

    @staticmethod
    def function_call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def body(self, builder: Any, output: list[dict[str, Any]], status: str | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole object; `status` from the builder's finish reason unless given."""
        data = self.data
        finish = builder.finish_reason if builder is not None else None
        if status is None:
            status = "incomplete" if finish == "length" else "completed"
        usage = None
        if builder is not None:
            usage = {"input_tokens": builder.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": builder.cached_tokens},
                     "output_tokens": builder.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": builder.prompt_tokens + builder.completion_tokens}
        text = data.get("text") or {}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
                else None,
                "instructions": data.get("instructions"), "max_output_tokens": data.get("max_output_tokens"),
                "model": self.model, "output": output,
                "parallel_tool_calls": data.get("parallel_tool_calls", True), "previous_response_id": None,
                "reasoning": None, "store": False, "temperature": data.get("temperature", 1.0),
                "text": {"format": text.get("format") or {"type": "text"}},
                "tool_choice": data.get("tool_choice", "auto"), "tools": data.get("tools") or [],
                "top_p": data.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
                "user": data.get("user"), "metadata": data.get("metadata") or {}}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class EventWriter:
    """Turns the chat path's deltas (``{"content"}``, ``{"tool_calls": [...]}``) into Responses events, one output
    item open at a time; ``items`` collects the finished items as they were streamed."""

    def __init__(self, out: ResponseObject) -> None:
        self.out = out
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # the chat delta's call index -> its item

    def emit(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self.close("completed")
                out += self._open(self.out.message("", "in_progress"))
                out.append(self.emit("response.content_part.added", item_id=self.open["id"], output_index=self.index,
                                     content_index=0, part=output_text("")))
            self.text.append(delta["content"])
            out.append(self.emit("response.output_text.delta", item_id=self.open["id"], output_index=self.index,
                                 content_index=0, delta=delta["content"], logprobs=[]))
        for piece in delta.get("tool_calls") or ():
            fn = piece.get("function") or {}
            if piece.get("id"):  # a new call
                out += self.close("completed")
                out += self._open(self.out.function_call(piece["id"], fn.get("name") or "", "", "in_progress"))
                self.calls[piece["index"]] = self.open
            item = self.calls.get(piece["index"])
            args = fn.get("arguments") or ""
            if item is not None and args:
                item["arguments"] += args
                out.append(self.emit("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.items.index(item), delta=args))
        return out

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        self.items.append(item)
        self.open = item
        return [self.emit("response.output_item.added", output_index=self.index, item=dict(item))]

    def close(self, status: str) -> list[bytes]:
        """End the open item (its status: ``completed``, or ``incomplete`` when the output was cut)."""
        item, self.open = self.open, None
        if item is None:
            return []
        out = []
        item["status"] = status
        if item["type"] == "message":
            text, self.text = "".join(self.text), []
            item["content"] = [output_text(text)]
            out.append(self.emit("response.output_text.done", item_id=item["id"], output_index=self.index,
                                 content_index=0, text=text, logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=item["id"], output_index=self.index,
                                 content_index=0, part=output_text(text)))
        else:
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                                 name=item["name"], arguments=item["arguments"]))
        out.append(self.emit("response.output_item.done", output_index=self.index, item=dict(item)))
        return out
