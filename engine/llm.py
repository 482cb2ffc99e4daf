"""Offline generation with vLLM's API shape: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import CompletionOutput, RequestOutput
from pd_cluster.engine.sampling.params import SamplingParams, fanned_out


class LLM:
    """An engine in the mixed role, for batch generation in one process.

    Args:
        model: HF checkpoint folder; None means the embedded stories260K.
        **engine_args: engine flags as keywords (``page_size=16``, ``kv_cache_dtype="fp8_e4m3"``,
            ``kv_cache_memory="64MiB"``, ``chunked_prefill_size=7``, ...; see `pd_cluster.engine.args`).

    Raises:
        TypeError: an unknown engine argument.
        ValueError: an invalid one.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        engine_args.setdefault("role", "mixed")
        config = config_from_kwargs(model=model, **engine_args)
        if config.parallel.enable_dp_attention:  # one engine per DP rank (`pd_cluster.engine.executor.dp`)
            from pd_cluster.engine.executor.dp import DPAttentionEngine

            self.engine = DPAttentionEngine(config)
        else:
            self.engine = LLMEngine(config)
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no params (vLLM's method): the generation config's sampling
        fields (``--generation-config``; ``max_new_tokens`` as ``max_tokens``) over `SamplingParams`' defaults.
        Params passed to `generate` are used as given (vLLM's ``LLM`` does not merge them either); the
        generation config's EOS ids end every request."""
        return SamplingParams(**self.engine.generation.sampling)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, data_parallel_rank: int | list[int | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        Args:
            prompts: one text, texts, or lists of token ids.
            sampling_params: one for all, or one per prompt (default: `get_default_sampling_params`). ``n`` > 1 fans out
                into ``n`` engine requests (`fanned_out`: seeds ``seed + i``), whose sequences come back together
                in one `RequestOutput` (``outputs[i].index == i``), as vLLM's ``LLM`` returns them.
            use_tqdm: show a progress bar.
            data_parallel_rank: under ``enable_dp_attention``, the DP rank of every prompt, or one per prompt
                (None: the engine picks; SGLang's request field).

        Raises:
            RequestRejected: a prompt is invalid or too long; nothing is left queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or self.get_default_sampling_params()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        fans = [fanned_out(p) for p in params_list]
        ranks = data_parallel_rank if isinstance(data_parallel_rank, list) else [data_parallel_rank] * len(prompts)
        if len(ranks) != len(prompts):
            raise ValueError(f"got {len(ranks)} data_parallel_rank values for {len(prompts)} prompts")
        if any(r is not None for r in ranks) and not hasattr(self.engine, "pick_rank"):
            raise ValueError("data_parallel_rank needs an engine started with enable_dp_attention")
        ids = self._add_all([pr for pr, f in zip(prompts, fans) for _ in f], [p for f in fans for p in f],
                            [r for r, f in zip(ranks, fans) for _ in f])
        results = self._run(ids, use_tqdm)
        outs, k = [], 0
        for prompt, f in zip(prompts, fans):
            group = [results[rid] for rid in ids[k:k + len(f)]]
            k += len(f)
            first = group[0]
            first.prompt = prompt if isinstance(prompt, str) else None
            for i, r in enumerate(group):
                r.outputs[0].index = i
            first.outputs = [r.outputs[0] for r in group]
            outs.append(first)
        return outs

    def _add_all(self, prompts: list, params_list: list[SamplingParams], ranks: list[int | None]) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p, rank in zip(prompts, params_list, ranks):
                rid = str(self._next_id)
                self._next_id += 1
                if rank is None:
                    self.engine.add_request(rid, prompt, p)
                else:
                    self.engine.add_request(rid, prompt, p, data_parallel_rank=rank)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            while self.engine.has_work():
                self.engine.step()
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        pending = {rid: self.engine.requests[rid] for rid in ids}
        results: dict[str, RequestOutput] = {}
        text: dict[str, list[str]] = {rid: [] for rid in ids}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        while len(results) < len(ids):
            for d in self.engine.step().deltas:
                if d.request_id not in pending:
                    continue
                text[d.request_id].append(d.new_text)
                if d.finished:
                    req = pending[d.request_id]
                    out = CompletionOutput(0, "".join(text[d.request_id]), req.output_token_ids, d.finish_reason,
                                           d.stop_reason, req.logprobs if req.params.logprobs is not None else None)
                    if out.logprobs is not None:
                        out.cumulative_logprob = sum(lp for lp, _ in out.logprobs)
                    results[d.request_id] = RequestOutput(d.request_id, None, req.prompt_token_ids, [out], True,
                                                          d.prompt_logprobs, d.num_cached_tokens)
                    bar.update(1)
        bar.close()
        return results
