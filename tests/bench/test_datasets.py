"""Datasets: exact synthetic lengths, ShareGPT shapes, shared prefixes, the Azure trace, scaling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pd_cluster.bench.config import DatasetConfig, LengthScaling
from pd_cluster.bench.datasets import DEFAULT_PATHS, load_dataset
from pd_cluster.bench.datasets.synth import safe_vocab
from pd_cluster.bench.tokenizer import load_tokenizer, resolve_tokenizer_name


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_tokenizer_name(None, "stories260K"))


def test_safe_vocabulary_round_trips(tok):
    words = safe_vocab(tok)
    assert len(words) >= 8
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.choice(words, size=300).tolist()
        assert tok.encode(tok.decode(ids)) == ids


def test_random_lengths_are_exact_and_in_vllms_range(tok):
    ds = load_dataset(DatasetConfig(name="random", num_prompts=300, random_input_len=100,
                                    random_output_len=40, random_range_ratio=0.25, random_prefix_len=10), tok)
    ins = [r.prompt_len for r in ds.requests]
    outs = [r.output_len for r in ds.requests]
    assert [len(tok.encode(r.prompt)) for r in ds.requests] == ins
    assert min(ins) >= 10 + 75 and max(ins) <= 10 + 125 and len(set(ins)) > 20
    assert min(outs) >= 30 and max(outs) <= 50
    prefixes = {tuple(tok.encode(r.prompt)[:10]) for r in ds.requests}
    assert len(prefixes) == 1  # --random-prefix-len tokens are shared by every prompt
    again = load_dataset(DatasetConfig(name="random", num_prompts=300, random_input_len=100,
                                       random_output_len=40, random_range_ratio=0.25, random_prefix_len=10), tok)
    assert [r.prompt for r in again.requests] == [r.prompt for r in ds.requests]  # seeded


def test_sharegpt_takes_the_first_human_turn_and_the_reply_length(tok, tmp_path):
    data = [
        {"conversations": [{"from": "system", "value": "be nice"},
                           {"from": "human", "value": "Once upon a time there was a dog"},
                           {"from": "gpt", "value": "The dog was happy and ran to the park"}]},
        {"prompt": "One day a little girl went out", "response": "She saw a bird"},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},  # too short
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    ds = load_dataset(DatasetConfig(name="sharegpt", path=str(path)), tok)
    got = sorted((r.prompt, r.prompt_len, r.output_len) for r in ds.requests)
    want = sorted([("Once upon a time there was a dog", tok.count("Once upon a time there was a dog"),
                    tok.count("The dog was happy and ran to the park")),
                   ("One day a little girl went out", tok.count("One day a little girl went out"),
                    tok.count("She saw a bird"))])
    assert got == want
    fixed = load_dataset(DatasetConfig(name="sharegpt", path=str(path), sharegpt_output_len=7), tok)
    assert {r.output_len for r in fixed.requests} == {7}


def test_shipped_sharegpt_slices_load(tok):
    ds = load_dataset(DatasetConfig(name="sharegpt", num_prompts=20, scaling=LengthScaling(max_input_len=300)), tok)
    assert len(ds.requests) == 20 and all(0 < r.prompt_len <= 300 for r in ds.requests)
    assert ds.num_capped_input > 0 and "capped" in ds.scaling_line()
    with pytest.raises(ValueError, match="--sharegpt-output-len"):
        load_dataset(DatasetConfig(name="sharegpt", path=str(DEFAULT_PATHS["sharegpt"].parent / "sharegpt_300.json")), tok)


def test_generated_shared_prefix_groups_share_exactly_their_system_prompt(tok):
    ds = load_dataset(DatasetConfig(name="generated-shared-prefix", gsp_num_groups=4, gsp_prompts_per_group=6,
                                    gsp_system_prompt_len=64, gsp_question_len=16, gsp_output_len=32), tok)
    assert len(ds.requests) == 24
    ids = [tok.encode(r.prompt) for r in ds.requests]
    assert all(len(x) == 80 for x in ids) and {r.output_len for r in ds.requests} == {32}
    systems = [tuple(x[:64]) for x in ids]
    assert sorted(systems.count(s) for s in set(systems)) == [6, 6, 6, 6]
    assert len({tuple(x[64:]) for x in ids}) == 24  # questions differ


def test_azure_trace_timestamps_and_lengths(tok):
    ds = load_dataset(DatasetConfig(name="azure-trace", num_prompts=3,
                                    scaling=LengthScaling(0.1, 1.0, 400, None)), tok)
    # rows: 18:17:03.97996 (4808, 10), 18:17:04.03196 (3180, 8), 18:17:04.078149 (110, 27)
    assert [r.timestamp for r in ds.requests] == pytest.approx([0.0, 0.052, 0.098189])
    assert [r.prompt_len for r in ds.requests] == [400, 318, 11]  # 481 capped at 400
    assert [r.output_len for r in ds.requests] == [10, 8, 27]
    assert ds.num_capped_input == 1
    assert ds.scaling_line() == "Length scaling: input x0.1 (cap 400), output x1 (no cap); capped: 1 inputs, 0 outputs"


def test_unscaled_runs_state_it_too():
    assert LengthScaling().describe() == "input x1 (no cap), output x1 (no cap)"
    with pytest.raises(ValueError):
        LengthScaling(input_scale=0)
