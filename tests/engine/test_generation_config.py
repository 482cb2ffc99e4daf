"""``generation_config.json`` (``--generation-config {auto,vllm,FOLDER}``, vLLM's flag): what is read, taken,
refused and warned about, and, on a tiny random Llama whose file adds an end-of-turn id that greedy decoding
reaches, that the offline engine stops exactly where transformers' ``generate()`` does."""

from __future__ import annotations

import json
import logging

import pytest
from random_models import build_with_end_of_turn, hf_stop

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model.generation_config import GenerationDefaults, load_generation_config

MAX_TOKENS = 24


def _write(folder, name="generation_config.json", **cfg):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(cfg))
    return folder


# ---- parsing ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,ids", [(7, (7,)), ([2, 9, 7, 9], (2, 7, 9)), (None, ()), ([], ())])
def test_eos_token_id_int_or_list(tmp_path, value, ids):
    assert load_generation_config("auto", _write(tmp_path, eos_token_id=value)).eos_token_ids == ids


def test_sampling_fields_taken_max_new_tokens_as_max_tokens(tmp_path):
    folder = _write(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                    repetition_penalty=1.05, max_new_tokens=512, presence_penalty=0.3, bos_token_id=1, top_h=None)
    g = load_generation_config("auto", folder)
    assert g.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                          "max_tokens": 512}
    assert not g.max_tokens_cap and g.not_applied == ()  # presence_penalty: not a transformers key; null: unset
    assert SamplingParams(**g.sampling).temperature == 0.6  # every taken value is a valid SamplingParams field


def test_vllm_mode_keeps_the_eos_ids_and_takes_no_default(tmp_path):
    folder = _write(tmp_path, eos_token_id=[2, 32007], temperature=0.6, num_beams=4, max_length=4096)
    g = load_generation_config("vllm", folder)
    assert (g.eos_token_ids, g.sampling, g.not_applied) == ((2, 32007), {}, ())  # nothing refused or warned either


def test_a_folder_replaces_the_model_folder_and_caps_max_tokens(tmp_path):
    model = _write(tmp_path / "model", eos_token_id=2, temperature=0.6)
    other = _write(tmp_path / "other", eos_token_id=[5, 6], top_p=0.5, max_new_tokens=64)
    g = load_generation_config(str(other), model)
    assert (g.eos_token_ids, g.sampling, g.max_tokens_cap) == ((5, 6), {"top_p": 0.5, "max_tokens": 64}, True)
    assert g.source == str(other / "generation_config.json")
    with pytest.raises(ValueError, match="--generation-config .*empty: no generation_config.json"):
        load_generation_config(str(tmp_path / "empty"), model)


def test_without_the_file_config_json_generation_keys_are_read(tmp_path):
    folder = _write(tmp_path, name="config.json", eos_token_id=[2, 3], temperature=0.7, hidden_size=64,
                    architectures=["LlamaForCausalLM"])
    g = load_generation_config("auto", folder)
    assert (g.eos_token_ids, g.sampling, g.not_applied) == ((2, 3), {"temperature": 0.7}, (("do_sample", None),))
    assert load_generation_config("auto", tmp_path / "nothing") == GenerationDefaults("auto")


@pytest.mark.parametrize("key,value", [("num_beams", 4), ("num_beam_groups", 2), ("penalty_alpha", 0.6),
                                       ("guidance_scale", 1.5), ("dola_layers", "high"),
                                       ("force_words_ids", [[5]]), ("constraints", [{"x": 1}])])
def test_decoding_algorithms_the_engine_does_not_run_are_refused(tmp_path, key, value):
    folder = _write(tmp_path, **{key: value})
    with pytest.raises(ValueError, match=rf"generation_config.json: {key}=.*--generation-config vllm"):
        load_generation_config("auto", folder)


def test_neutral_values_of_refused_keys_pass(tmp_path):
    folder = _write(tmp_path, num_beams=1, num_beam_groups=1, penalty_alpha=0.0, guidance_scale=1.0,
                    length_penalty=1.2, early_stopping=True, constraints=None)
    assert load_generation_config("auto", folder).not_applied == ()  # beam-only keys act on no sampled sequence


def test_keys_transformers_would_apply_are_named_as_not_applied(tmp_path):
    folder = _write(tmp_path, max_length=4096, no_repeat_ngram_size=3, typical_p=0.9, min_length=0,
                    epsilon_cutoff=0.0, suppress_tokens=[], use_cache=True, pad_token_id=0, chat_format="chatml",
                    do_sample=False, temperature=0.6)
    got = dict(load_generation_config("auto", folder).not_applied)
    assert got == {"max_length": 4096, "no_repeat_ngram_size": 3, "typical_p": 0.9, "do_sample": False}


def test_do_sample_is_named_only_when_sampling_defaults_are_taken(tmp_path):
    assert load_generation_config("auto", _write(tmp_path / "a", do_sample=False, eos_token_id=2)).not_applied == ()
    assert load_generation_config("auto", _write(tmp_path / "b", do_sample=True, top_k=64)).not_applied == ()
    assert load_generation_config("auto", _write(tmp_path / "c", top_p=0.9)).not_applied == (("do_sample", None),)


@pytest.mark.parametrize("key,value", [("temperature", -0.5), ("temperature", True), ("top_p", 0), ("top_p", 1.5),
                                       ("top_k", 2.5), ("min_p", 2), ("repetition_penalty", 0),
                                       ("max_new_tokens", 0), ("eos_token_id", "2"), ("eos_token_id", [2, -1])])
def test_bad_values_are_refused_by_name(tmp_path, key, value):
    with pytest.raises(ValueError, match=rf"generation_config.json: {key} must be"):
        load_generation_config("auto", _write(tmp_path, **{key: value}))


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_generation_config("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        load_generation_config("auto", tmp_path)


def test_max_tokens_default_fits_the_context_and_caps_only_from_a_folder():
    auto = GenerationDefaults("auto", "f", (), {"max_tokens": 100})
    folder = GenerationDefaults("/cfg", "f", (), {"max_tokens": 100}, max_tokens_cap=True)
    assert [auto.resolve_max_tokens(r, room) for r, room in ((None, 500), (None, 30), (None, 0), (500, 50))] == \
        [100, 30, 1, 500]
    assert [folder.resolve_max_tokens(r, 500) for r in (None, 40, 500)] == [100, 40, 100]
    assert GenerationDefaults().resolve_max_tokens(None, 30) is None  # the engine fills it (up to the context)
    assert auto.pick("temperature", None, 1.0) == 1.0 and folder.pick("max_tokens", 7, None) == 7


def test_start_up_log_names_what_was_taken_and_not_applied(tmp_path, caplog):
    g = load_generation_config("auto", _write(tmp_path, eos_token_id=[2, 7], temperature=0.6, top_p=0.9,
                                              max_length=4096, do_sample=True))
    with caplog.at_level(logging.INFO, logger="engine"):
        g.log((2, 7))
    text = caplog.text
    assert "Default sampling parameters have been overridden by the model's Hugging Face generation config" in text
    assert "temperature=0.6, top_p=0.9" in text and "--generation-config vllm" in text
    assert "EOS token ids [2, 7] end generation" in text
    assert "not applied" in text and "max_length=4096" in text


# ---- the engine, offline, against transformers -------------------------------------------------------------
@pytest.fixture(scope="module")
def eot_model(tmp_path_factory):
    """(folder, transformers model, prompt ids, its greedy continuation with no stop, the end-of-turn id)."""
    folder = tmp_path_factory.mktemp("eot")
    return (folder, *build_with_end_of_turn(folder, MAX_TOKENS, temperature=0.6, top_p=0.9, do_sample=True))


def test_offline_greedy_stops_at_the_added_eos_as_transformers_generate(eot_model):
    folder, model, prompt, greedy, eot = eot_model
    k = greedy.index(eot)
    # transformers reads the same generation_config.json (its eos list): it stops there, and not at once
    assert hf_stop(model, prompt, MAX_TOKENS) == greedy[:k + 1] and k >= 4
    llm = LLM(model=str(folder), kv_cache_memory="16MiB")
    assert eot in llm.engine.eos_token_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (greedy[:k + 1], "stop", None)
    go_on = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert (go_on[0].outputs[0].token_ids, go_on[0].outputs[0].finish_reason) == (greedy, "length")
    late = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=k + 1))
    banned = late[0].outputs[0].token_ids
    assert banned[:k] == greedy[:k] and banned[k] != eot  # min_tokens bans the added id like any EOS


def test_offline_defaults_are_the_generation_configs_unless_params_are_given(eot_model):
    folder, _, prompt, *_ = eot_model
    llm = LLM(model=str(folder), kv_cache_memory="16MiB")
    received = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda rid, p, params, **kw: received.append(params) or add(rid, p, params, **kw)
    assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().top_p) == (0.6, 0.9)
    llm.generate([prompt])
    llm.generate([prompt], SamplingParams(max_tokens=3, temperature=1.0))
    assert [(p.temperature, p.top_p, p.max_tokens) for p in received] == [(0.6, 0.9, 16), (1.0, 1.0, 3)]


def test_vllm_mode_takes_the_engine_defaults_and_still_stops_at_the_eos(eot_model):
    folder, _, prompt, greedy, eot = eot_model
    llm = LLM(model=str(folder), kv_cache_memory="16MiB", generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].outputs[0]
    assert out.token_ids == greedy[:greedy.index(eot) + 1]  # as vLLM: the model's EOS ids in every mode


def test_a_generation_config_folder_replaces_the_models(eot_model, tmp_path):
    folder, _, prompt, greedy, eot = eot_model
    k = greedy.index(eot)
    later = next(t for i, t in enumerate(greedy) if i > k and t not in greedy[:i] and t > 2)
    _write(tmp_path, eos_token_id=later, max_new_tokens=20, temperature=0.0)
    llm = LLM(model=str(folder), kv_cache_memory="16MiB", generation_config=str(tmp_path))
    assert eot not in llm.engine.eos_token_ids and later in llm.engine.eos_token_ids
    out = llm.generate([prompt])[0].outputs[0]  # the folder's defaults: greedy, 20 tokens at most
    assert out.token_ids == greedy[:min(greedy.index(later) + 1, 20)]


def test_pd_generate_takes_the_defaults_under_its_flags(eot_model, monkeypatch, capsys):
    from pd_cluster.launch import generate

    folder = eot_model[0]
    received = []
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params: received.append(params) or [])
    base = ["Hi", "--model", str(folder), "--kv-cache-memory", "16MiB"]
    for argv in ([], ["--temperature", "0", "--max-tokens", "5"], ["--generation-config", "vllm"]):
        generate.main(base + argv)
    assert [(p.temperature, p.top_p, p.max_tokens) for p in received] == [(0.6, 0.9, 64), (0.0, 0.9, 5),
                                                                          (0.0, 1.0, 64)]
