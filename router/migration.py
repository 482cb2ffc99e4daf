"""Request migration: a stream whose decode worker died or went silent continues on another pair.

The idea is NVIDIA Dynamo's request migration (``--migration-limit``): the
router remembers every token id already relayed, and when the decode worker
fails mid-stream it sends the same request to a fresh pair with those ids as
``resume_token_ids`` (docs/worker-api.md). The new worker computes the KV of
the prompt and those tokens, replays them into everything that depends on the
output so far (``max_tokens`` and ``min_tokens``, presence and frequency
penalties, a structured-output grammar, a seeded generator's draws, a tool-call
parser, logprob offsets) and streams on from the next token without sending
their text again. The client's stream goes on with no token lost or repeated;
greedy and seeded streams equal an undisturbed run token for token.

Token ids come from the worker in vLLM's ``return_token_ids`` shape: the router
asks for them (``"return_token_ids": true``), the first chunk carries
``prompt_token_ids`` (top level for chat, on the choice for completions) and
each chunk's choice carries the ``token_ids`` it adds. They are removed from
what the client sees unless the client asked for them itself.

Migrated are streams with any number of choices (``n``, several prompts) and
none of ``echo``, ``best_of``, ``suffix`` or ``prompt_logprobs`` (they are about
the prompt, which a continuation would answer again). With several choices the
router keeps each choice's ids apart (by its ``index``) and the continuation
carries one list per choice, ``null`` for a choice that already finished (the
new worker does not generate it again); each choice goes on exactly where it
stopped, and the final ``usage`` is recomputed over every choice. Non-streamed
requests send nothing before they finish, so a failed one is re-dispatched
whole (see ``router.proxy``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

def plan_body(data: dict[str, Any], chat: bool, raw: bytes | None = None) -> tuple[bytes, "StreamTracker"] | None:
    """The body to send a worker for a migratable streamed request, and its tracker.

    ``raw``: the client's body as received (``data`` parsed): the router's one field is put in front of it
    instead of writing the whole body again. ``None`` when the request cannot be migrated (it is then
    forwarded unchanged).
    """
    if not data.get("stream"):
        return None
    n = data.get("n", 1)
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None  # the worker refuses it
    if data.get("echo") or data.get("suffix") or data.get("best_of") not in (None, 1) \
            or data.get("prompt_logprobs") is not None:
        return None
    num_choices = n * (1 if chat else _num_prompts(data.get("prompt")))
    if num_choices > 1 and data.get("resume_token_ids") is not None:
        return None  # a client resuming several choices itself
    client_ids = data.get("return_token_ids") is True
    opts = data.get("stream_options") if isinstance(data.get("stream_options"), dict) else {}
    tracker = StreamTracker(data=data, chat=chat, client_wants_ids=client_ids,
                            client_wants_usage=bool(opts.get("include_usage")), num_choices=num_choices, n=n)
    brace = len(raw) - len(raw.lstrip(b" \t\r\n")) if raw is not None else -1
    if raw is not None and "return_token_ids" not in data and raw[brace:brace + 1] == b"{" \
            and raw[brace + 1:brace + 2] != b"\x00":  # a UTF-8 object, not empty ("stream" is in it)
        return raw[:brace + 1] + b'"return_token_ids":true,' + raw[brace + 1:], tracker
    if client_ids:
        return raw if raw is not None else json.dumps(data, separators=(",", ":")).encode(), tracker
    return json.dumps(dict(data, return_token_ids=True), separators=(",", ":")).encode(), tracker


def _num_prompts(prompt: Any) -> int:
    """The prompts of ``prompt``: a list of texts or token-id lists holds one each (one choice per prompt and
    ``n``)."""
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


@dataclass
class StreamTracker:
    """What one migratable stream has relayed so far: ids, identity of the stream, usage.

    Not thread-safe; one per request. ``feed`` takes the payload of one SSE
    ``data:`` event and returns the bytes to relay to the client.
    """

    data: dict[str, Any]
    chat: bool
    client_wants_ids: bool
    client_wants_usage: bool
    num_choices: int = 1
    n: int = 1
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)  # choice 0's ids (the only choice of a one-choice stream)
    outputs: dict[int, list[int]] = field(default_factory=dict)  # every choice's ids, by index
    choice_prompts: dict[int, list[int]] = field(default_factory=dict)  # completions: each choice's prompt ids
    done_choices: set[int] = field(default_factory=set)
    stream_id: str | None = None
    created: int | None = None
    model: str | None = None
    migrations: int = 0
    finished: bool = False  # a finish_reason was relayed
    done: bool = False      # [DONE] was relayed
    continuing: bool = False  # events now come from a /v1/completions continuation
    errored: bool = False     # the worker sent an error event: the stream ends with it
    worker_died: bool = False  # the worker said its engine died (``engine_dead``): this attempt failed, not the stream
    death_event: bytes = b""   # that event, to end the stream with when no other worker can continue it
    no_ids: bool = False      # tokens came without ids: the worker cannot give them

    def __post_init__(self) -> None:
        self.outputs[0] = self.generated

    @property
    def multi(self) -> bool:
        """Several choices (``n`` > 1 or several prompts)."""
        return self.num_choices > 1

    @property
    def num_relayed(self) -> int:
        """Token ids relayed so far, over every choice."""
        return sum(len(ids) for ids in self.outputs.values())

    @property
    def ended(self) -> bool:
        """The stream reached its end ([DONE], or an error event the worker sent)."""
        return self.done or self.errored

    @property
    def can_migrate(self) -> bool:
        """True once the worker gave token ids and the stream still has tokens to come."""
        return self.prompt_ids is not None and not self.finished and not self.ended

    def synthetic_end(self) -> bytes:
        """The events that end a stream whose ``max_tokens`` were all relayed before its worker
        failed: a ``length`` finish of each unfinished choice, the usage if asked, ``[DONE]``."""
        head = {"id": self.stream_id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model}
        out = []
        for index in range(self.num_choices):
            if index in self.done_choices:
                continue
            choice: dict[str, Any] = {"index": index}
            choice.update({"delta": {}} if self.chat else {"text": ""})
            choice.update({"logprobs": None, "finish_reason": "length"})
            out.append(dict(head, choices=[choice]))
        if self.client_wants_usage:
            out.append(dict(head, choices=[], usage=self._usage()))
        self.finished = self.done = True
        return b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
                        for e in out) + b"data: [DONE]\n\n"

    def _usage(self) -> dict[str, int]:
        """The whole answer's usage from the ids relayed: each prompt once, every choice's output."""
        if self.multi and not self.chat:
            per_prompt = {i // self.n: len(ids) for i, ids in self.choice_prompts.items()}
            prompt = sum(per_prompt.values())
        else:
            prompt = len(self.prompt_ids or [])
        completion = self.num_relayed + len(self.data.get("resume_token_ids") or []) * (not self.multi)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def remaining_max_tokens(self) -> int | None:
        """Tokens ``max_tokens`` still allows (the most over the unfinished choices); None: no limit."""
        limit = self.data.get("max_completion_tokens") if self.chat else None
        if limit is None:
            limit = self.data.get("max_tokens")
        if limit is None and not self.chat:
            limit = 16  # OpenAI's (and the workers') completions default
        if limit is None:
            return None
        if self.multi:
            return max((int(limit) - len(self.outputs.get(i, ())) for i in range(self.num_choices)
                        if i not in self.done_choices), default=0)
        return int(limit) - len(self.generated) - len(self.data.get("resume_token_ids") or [])

    def continuation_body(self) -> bytes:
        """The request again, continuing after the ids relayed so far (``resume_token_ids``: one list, or one per
        choice with ``null`` for those that finished)."""
        self.worker_died = False  # a new attempt
        body = dict(self.data, stream=True, return_token_ids=True)
        if self.multi:
            body["resume_token_ids"] = [None if i in self.done_choices else list(self.outputs.get(i, ()))
                                        for i in range(self.num_choices)]
        else:
            body["resume_token_ids"] = list(self.data.get("resume_token_ids") or []) + self.generated
        return json.dumps(body, separators=(",", ":")).encode()

    def feed(self, payload: bytes) -> bytes | None:
        """One event's payload (after ``data: ``) -> the event to relay, or ``None`` to drop it."""
        if self.worker_died:
            return None  # what the attempt sends after its worker's engine died is not the stream's
        if payload.strip() == b"[DONE]":
            self.done = True
            return b"data: [DONE]\n\n"
        if self.prompt_ids is not None and not self.continuing and not self.multi:
            fast = self._scan(payload)
            if fast is not None:
                return fast
        try:
            event = json.loads(payload)
        except ValueError:
            return b"data: " + payload + b"\n\n"
        if not isinstance(event, dict) or "error" in event:
            if _engine_died(event) and self.can_migrate:  # a dead worker, as a broken stream: migrate
                self.worker_died, self.death_event = True, b"data: " + payload + b"\n\n"
                return None
            self.errored = self.errored or isinstance(event, dict)
            return b"data: " + payload + b"\n\n"
        if self.continuing:
            event = self._as_original(event)
            if event is None:
                return None
        else:
            self._learn(event)
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    def _scan(self, payload: bytes) -> bytes | None:
        """`feed` without parsing the JSON, for the events after the first of an undisturbed stream: the
        token ids are read from the bytes (``"token_ids":[...]``) and cut out unless the client asked for
        them. None when the event is not in the one shape read this way (compact JSON, one choice, no
        error, no prompt ids): the caller parses it then."""
        if b'"error"' in payload or b"prompt_token_ids" in payload:
            return None
        start = payload.find(b'"token_ids":[')
        if start < 0:
            if b'"token_ids"' in payload:
                return None
            ids = None
        else:
            if payload.find(b'"token_ids"', start + 12) >= 0:
                return None  # several choices
            end = payload.find(b"]", start + 13)
            if end < 0:
                return None
            inner = payload[start + 13:end]
            try:
                ids = [int(t) for t in inner.split(b",")] if inner.strip() else []
            except ValueError:
                return None
        finished = False
        at = payload.find(b'"finish_reason":')
        if at >= 0:
            value = payload[at + 16:at + 17]
            if value == b'"':
                finished = True
            elif value != b"n":
                return None
        elif b'"finish_reason"' in payload:
            return None
        if ids is None or self.client_wants_ids:
            out = b"data: " + payload + b"\n\n"
        else:
            end += 1
            if payload[start - 1:start] == b",":
                start -= 1
            elif payload[end:end + 1] == b",":
                end += 1
            else:
                return None
            out = b"data: " + payload[:start] + payload[end:] + b"\n\n"
        if ids:
            self.generated.extend(ids)
        self.finished = self.finished or finished
        return out

    def _learn(self, event: dict[str, Any]) -> None:
        if self.stream_id is None:
            self.stream_id, self.created, self.model = (
                event.get("id"), event.get("created"), event.get("model"))
        top = event.pop("prompt_token_ids", None) if not self.client_wants_ids else \
            event.get("prompt_token_ids")
        if isinstance(top, list) and self.prompt_ids is None:
            self.prompt_ids = top
        for choice in event.get("choices") or ():
            self._take_choice(choice)
            if self.prompt_ids is None and (choice.get("text") or choice.get("token_ids") or (
                    choice.get("delta") or {}).get("content")):
                self.no_ids = True

    def _take_choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        index = index if isinstance(index, int) and 0 <= index < self.num_choices else 0
        pids = choice.get("prompt_token_ids") if self.client_wants_ids and not self.continuing else \
            choice.pop("prompt_token_ids", None)
        if isinstance(pids, list):
            self.prompt_ids = self.prompt_ids if self.prompt_ids is not None else pids
            self.choice_prompts.setdefault(index, pids)
        ids = choice.get("token_ids") if self.client_wants_ids else choice.pop("token_ids", None)
        if isinstance(ids, list):
            self.outputs.setdefault(index, []).extend(ids)
        if choice.get("finish_reason"):
            self.done_choices.add(index)
            self.finished = len(self.done_choices) >= self.num_choices

    def _as_original(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's event as the original stream's: its id, creation time and model; no second
        ``prompt_token_ids`` or assistant ``role``; the ids learnt. ``None`` for an event left empty."""
        event.pop("prompt_token_ids", None)
        event.update(id=self.stream_id, created=self.created, model=self.model)
        choices = []
        for choice in event.get("choices") or ():
            self._take_choice(choice)  # (drops the choice's prompt_token_ids, noting them for the usage)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
                if not any(v not in ("", None) for v in delta.values()) and choice.get("finish_reason") is None \
                        and choice.get("logprobs") is None and not choice.get("token_ids"):
                    continue  # a first chunk that carried only the role
            choices.append(choice)
        event["choices"] = choices
        if not choices and not isinstance(event.get("usage"), dict):
            return None
        if self.multi and isinstance(event.get("usage"), dict):  # the worker counted only the choices it continued
            event["usage"].update(self._usage())
        return event


def _engine_died(event) -> bool:
    """Whether `event` is a worker's ``engine_dead`` error (its engine loop died and it restarts,
    `pd_cluster.serving.errors`): the worker failed, not the request."""
    error = event.get("error") if isinstance(event, dict) else None
    return isinstance(error, dict) and error.get("code") == "engine_dead"
