"""The prompt's side of a completion: ``echo`` (the prompt's text and per-token logprobs before the output's) and
vLLM's ``prompt_logprobs`` field.

The engine returns one `PromptLogprob` per prompt token after the first: the logprob of that token given the
tokens before it (a log-softmax of the model's logits at the previous position), the top-N there, and the
token's rank. In PD the prefill worker computes them (it alone has the logits of every prompt position) and
they reach the decode worker with the prompt's KV (``prefill/jobs.py``).

Formats, as OpenAI's legacy completions and vLLM answer them:

* ``echo`` with ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset`` start with
  the prompt's tokens; the first prompt token has no context, so its ``token_logprobs`` and ``top_logprobs``
  entries are ``null``. This is what lm-eval's ``local-completions`` loglikelihood reads
  (``token_logprobs[ctxlen:-1]``, with ``max_tokens`` 1).
* ``prompt_logprobs`` (vLLM): a list with ``null`` for the first prompt token, then per token a map from token
  id (a string, JSON's keys) to ``{"logprob", "rank", "decoded_token"}`` holding the prompt token and the
  top-N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.outputs import PromptLogprob
from pd_cluster.serving.token_text import TokenTexts


@dataclass(frozen=True)
class PromptEcho:
    """What a choice needs to render its prompt: the text to echo, the ids, and how many top logprobs.

    Attributes:
        text: the prompt's text (as sent, or the decoded ids).
        token_ids: the prompt's token ids.
        echo: ``echo`` was asked (the text, and with ``logprobs`` the prompt's entries, lead the choice).
        echo_top: ``logprobs`` of the request (top-N for the echoed entries), or None.
        prompt_top: vLLM's ``prompt_logprobs`` (top-N), or None.
        drop_output: ``max_tokens`` 0: the token the engine generated is not returned.
    """

    text: str
    token_ids: list[int]
    echo: bool = False
    echo_top: int | None = None
    prompt_top: int | None = None
    drop_output: bool = False


def echo_entries(tokenizer: Any, echo: PromptEcho, lps: list[PromptLogprob] | None,
                 skip_special_tokens: bool) -> list[dict[str, Any]]:
    """The prompt's logprob entries (the shape `ResponseBuilder` keeps: ``token`` a `TokenText`, ``logprob``
    float or None, ``top`` [(TokenText, float)] or None), strings decoded in context from the first token.

    Raises:
        ValueError: `lps` does not cover every prompt token after the first.
    """
    ids = echo.token_ids
    if lps is None or len(lps) != len(ids) - 1:
        raise ValueError(f"prompt logprobs cover {0 if lps is None else len(lps)} of {len(ids) - 1} positions")
    texts = TokenTexts(tokenizer, [], skip_special_tokens)
    n = echo.echo_top or 0
    out = [{"token": texts.add(ids[0]), "logprob": None, "top": None}]
    for tok, (chosen, top, _rank) in zip(ids[1:], lps):
        candidates = [(texts.candidate(i), v) for i, v in top[:n]]
        out.append({"token": texts.add(tok), "logprob": chosen, "top": candidates})
    return out


def vllm_prompt_logprobs(tokenizer: Any, echo: PromptEcho,
                         lps: list[PromptLogprob] | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` list (module doc), or None when not asked or not available."""
    if echo.prompt_top is None or lps is None:
        return None
    n = echo.prompt_top
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for tok, (chosen, top, rank) in zip(echo.token_ids[1:], lps):
        entry = {str(tok): {"logprob": finite(chosen), "rank": rank,
                            "decoded_token": tokenizer.decode([tok])}}
        for r, (i, v) in enumerate(top[:n], start=1):
            entry.setdefault(str(i), {"logprob": finite(v), "rank": r, "decoded_token": tokenizer.decode([i])})
        out.append(entry)
    return out


def finite(logprob: float) -> float:
    """JSON has no -Infinity: an impossible token's logprob is -9999.0 (as vLLM answers)."""
    return max(float(logprob), -9999.0)
