"""``pd-generate``: offline generation with the engine, no servers.

Example::

    pd-generate "Once upon a time" --max-tokens 64 --temperature 0
    pd-generate --prompts-file prompts.txt --kv-cache-dtype fp8_e4m3 --page-size 16
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pd_cluster.engine.args import add_engine_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
                                prog="pd-generate", description="Offline generation on one engine (mixed role).")
    p.add_argument("prompts", nargs="*", help="prompts (default: one example prompt)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: the generation config's max_new_tokens, else 64")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the generation config's, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None, help="default: the generation config's, else 1")
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--log-level", default="warning")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.attention_backend == "triton":
        from pd_cluster.launch.interpreter import use_triton_interpreter_without_cuda

        use_triton_interpreter_without_cuda()  # before the kernels are imported
    from pd_cluster.engine import LLM, SamplingParams
    from pd_cluster.engine.args import ENGINE_FLAGS

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    prompts = prompts or ["Once upon a time"]
    engine_args = {f.dest: getattr(args, f.dest) for f in ENGINE_FLAGS}
    llm = LLM(**engine_args)
    # the generation config's sampling fields (--generation-config) under the flags given
    given = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                               ("top_p", args.top_p)) if v is not None}
    defaults = {"max_tokens": 64, "temperature": 0.0, **llm.engine.generation.sampling}
    params = SamplingParams(**{**defaults, **given}, seed=args.sampling_seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(f"{out.prompt}{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]\n")
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} prompt(s), {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.0f} tok/s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
