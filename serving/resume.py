"""``resume_token_ids`` on the worker's side: what a continued stream has already delivered, per choice.

The router's request migration resends a stream with the token ids it relayed (`pd_cluster.router.migration`).
Before the engine replays them (`pd_cluster.engine.request_builder`), the handler bounds the list (its cost grows
with it), recomputes the text those tokens delivered exactly as the engine's detokenizer streamed it, and, for
logprobs, the token strings in context, so that offsets go on after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.detokenizer import IncrementalDetokenizer
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.errors import HTTPError
from pd_cluster.serving.token_text import TokenTexts


@dataclass(frozen=True)
class Resumed:
    """A stream's delivered output: its token ids, the text they delivered, and (logprobs) `TokenTexts` past them."""

    token_ids: list[int]
    text: str = ""
    texts: TokenTexts | None = None


def prepare_resumed(tokenizer: Any, prompt_ids: list[int], params: SamplingParams, resumed: list[int],
                    context_length: int) -> Resumed:
    """Check and replay `resumed` (tokenizer thread).

    Raises:
        HTTPError: 400 (``param: resume_token_ids``) when the tokens leave nothing to generate within
            ``max_tokens`` or the context, or the output already ended with a stop string.
    """
    if not resumed:
        return Resumed([])
    limit = context_length - len(prompt_ids) if params.max_tokens is None else params.max_tokens
    if len(resumed) >= limit:  # before any replay: its cost grows with the list
        raise HTTPError(400, f"resume_token_ids: {len(resumed)} tokens leave nothing to generate within "
                             f"{'the context' if params.max_tokens is None else 'max_tokens'} ({limit})",
                        "resume_token_ids", "invalid_value")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                                   params.skip_special_tokens, params.min_tokens)
    text = detok.replay(resumed)
    if detok.stop_matched is not None:
        raise HTTPError(400, f"resume_token_ids: the output already ended with the stop string "
                             f"{detok.stop_matched!r}", "resume_token_ids", "invalid_value")
    texts = None
    if params.logprobs is not None:  # logprob strings and offsets go on after the resumed text
        texts = TokenTexts(tokenizer, prompt_ids, params.skip_special_tokens)
        for t in resumed:
            texts.add(t)
    return Resumed(resumed, text, texts)


NOTHING = Resumed([])


def prepare_resumed_choices(tokenizer: Any, prompts: list[list[int]], params: SamplingParams,
                            resumed: list[list[int] | None], n: int, context_length: int) -> list[Resumed | None]:
    """`prepare_resumed` for each choice of a request (choice ``i`` continues prompt ``i // n``); None for a choice
    that finished in an earlier attempt (it is not generated again). [] when nothing is resumed.

    Raises:
        HTTPError: 400 (``param: resume_token_ids``) when the lists do not match the choices one to one, when every
            choice already finished, or as `prepare_resumed`.
    """
    if not resumed:
        return []
    total = len(prompts) * n
    if len(resumed) != total:
        raise HTTPError(400, f"resume_token_ids: {len(resumed)} list(s) for {total} choice(s); give one list per "
                             "choice, null for a finished one", "resume_token_ids", "invalid_value")
    if all(r is None for r in resumed):
        raise HTTPError(400, "resume_token_ids: every choice already finished", "resume_token_ids", "invalid_value")
    return [None if r is None else prepare_resumed(tokenizer, prompts[i // n], params, r, context_length)
            for i, r in enumerate(resumed)]
