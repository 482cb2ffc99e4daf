"""Speculative decoding benchmark: NGRAM drafts (or a draft model's) at K = 2, 4, 8 against no speculation.

Workload. Prompts whose continuation repeats text already in the context, the case prompt lookup exists for:
an edit of a quoted passage, a summary that quotes its source, a list, a refrain. Each prompt runs alone
(batch 1), greedy, ``--max-tokens`` tokens with EOS ignored, on one in-process engine per setting (the embedded
stories260K unless ``--model``). Speculation is lossless: the script checks that every setting's tokens equal
the run without speculation and stops otherwise.

Per setting: mean accepted length (tokens per verification: 1 + accepted drafts, over drafted steps), tokens per
decode step (every decoding step, drafted or not), target steps per output token (the target's forward passes
after the prefill, over the tokens after the first), the draft acceptance rate, and wall-clock of all prompts
(best of ``--repeats``) against no speculation.

With ``--draft-model PATH`` the drafts come from that draft model (STANDALONE) instead of prompt lookup, and
the table adds the wall-clock spent in the draft model.

Run: ``python -m pd_cluster.bench.scripts.spec_decode`` (a minute on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import platform
import time

from pd_cluster.engine import LLM, SamplingParams

PROMPTS = [
    # an edit that copies most of its source
    "Tom had a red ball. He threw the ball to his dog. The dog ran fast and got the ball. "
    "Now tell it again with a blue ball: Tom had a blue ball. He threw the ball to his",
    # a summary that quotes its source
    "Lily went to the park with her mom. At the park Lily saw a big tree. Lily said, \"I want to climb the big "
    "tree.\" Her mom said, \"Be careful, Lily.\" Summary: Lily went to the park with her mom. Lily said,",
    # a list that repeats
    "one two three four five six seven eight nine ten. one two three four five six seven eight nine ten. one two",
    # a refrain
    "The little bird sang, \"Hello sun, hello sky!\" The little bird sang, \"Hello sun, hello sky!\" The little",
    # a plain story opening (little to look up)
    "Once upon a time, there was a little girl named",
]


def run_setting(k: int, args: argparse.Namespace) -> dict:
    kw = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=k) if k else {}
    if k and args.draft_model:
        kw.update(speculative_algorithm="STANDALONE", speculative_draft_model_path=args.draft_model)
    llm = LLM(model=args.model, **kw)
    eng = llm.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tokens, best = [], float("inf")
    for rep in range(args.repeats):
        steps = out_tokens = 0
        started = time.perf_counter()
        run_tokens = []
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(f"{rep}-{i}", prompt, params)
            n_steps, ids = 0, []
            while eng.has_work():
                n_steps += 1
                for d in eng.step().deltas:
                    ids += d.new_token_ids
            steps += n_steps - 1  # the first step is the prefill (each prompt fits one chunk)
            out_tokens += len(ids) - 1
            run_tokens.append(ids)
        best = min(best, time.perf_counter() - started)
        tokens = run_tokens
    draft = eng.drafter.model if eng.drafter is not None else None
    spec = eng.stats.spec
    row = {"k": k, "tokens": tokens, "wall_s": best, "steps_per_token": steps / out_tokens}
    if spec is not None and spec.num_drafts:
        row["accept_len"] = spec.mean_accept_length
        row["accept_rate"] = spec.num_accepted_tokens / spec.num_draft_tokens
        row["drafted"] = spec.num_drafts / args.repeats
    if draft is not None:
        row["draft_s"] = draft.seconds / args.repeats  # mean per run
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded stories260K)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs per setting; the best wall-clock is kept")
    p.add_argument("--ks", default="2,4,8", help="draft tokens per step to compare")
    p.add_argument("--draft-model", default=None, help="STANDALONE: the draft model's folder (default: NGRAM)")
    args = p.parse_args(argv)
    rows = [run_setting(0, args)] + [run_setting(int(k), args) for k in args.ks.split(",")]
    base = rows[0]
    for r in rows[1:]:
        if r["tokens"] != base["tokens"]:
            raise SystemExit(f"K={r['k']}: tokens differ from the run without speculation (not lossless)")
    method = f"STANDALONE draft model {args.draft_model}" if args.draft_model else "NGRAM"
    print(f"# {method}; {len(PROMPTS)} prompts, batch 1, greedy, {args.max_tokens} tokens each; "
          f"{platform.machine()} {platform.processor() or ''}; best of {args.repeats}")
    extra = " draft model (s) |" if args.draft_model else ""
    print("| K | mean accepted length | drafted steps per run | acceptance rate | target steps per output token "
          f"| wall-clock (s) | vs no speculation |{extra}")
    print("| --- " * (8 if args.draft_model else 7) + "|")
    for r in rows:
        name = "off" if not r["k"] else str(r["k"])
        acc = f"{r['accept_len']:.2f}" if "accept_len" in r else "-"
        rate = f"{r['accept_rate']:.2f}" if "accept_rate" in r else "-"
        drafted = f"{r['drafted']:.0f}" if "drafted" in r else "-"
        draft_s = (f" {r['draft_s']:.3f} |" if "draft_s" in r else " - |") if args.draft_model else ""
        print(f"| {name} | {acc} | {drafted} | {rate} | {r['steps_per_token']:.3f} | {r['wall_s']:.3f} | "
              f"{base['wall_s'] / r['wall_s']:.2f}x |{draft_s}")


if __name__ == "__main__":
    main()
