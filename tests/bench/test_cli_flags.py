"""pd-bench's command line: no abbreviations, vLLM's generic length flags, exit status on total failure."""

from __future__ import annotations

import pytest

from pd_cluster.bench.args import build_parser, to_config
from pd_cluster.bench.cli import main
from pd_cluster.bench.fake_config import parse_args as fake_parse_args


def _cfg(*flags: str):
    return to_config(build_parser().parse_args(list(flags)))


def test_abbreviations_are_refused(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--input-len-s", "16"])  # once read as --input-len-scale
    assert "unrecognized arguments: --input-len-s" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fake_parse_args(["--ttft", "5"])  # once read as --ttft-ms
    assert "unrecognized arguments: --ttft" in capsys.readouterr().err


def test_input_len_and_output_len_mean_vllms_random_lengths():
    cfg = _cfg("--input-len", "16", "--output-len", "4")
    d = cfg.dataset
    assert (d.name, d.random_input_len, d.random_output_len) == ("random", 16, 4)
    assert (d.scaling.input_scale, d.scaling.output_scale) == (1.0, 1.0)  # not the *-scale flags
    same = _cfg("--input-len", "16", "--random-input-len", "16").dataset
    assert same.random_input_len == 16 and same.random_output_len == 128


def test_output_len_fixes_sharegpt_output():
    assert _cfg("--dataset-name", "sharegpt", "--output-len", "7").dataset.sharegpt_output_len == 7


@pytest.mark.parametrize("flags,message", [
    (("--dataset-name", "mooncake-trace", "--input-len", "16"),
     "--input-len has no meaning for --dataset-name mooncake-trace"),
    (("--dataset-name", "sharegpt", "--input-len", "16"), "--input-len has no meaning for --dataset-name sharegpt"),
    (("--dataset-name", "burstgpt", "--output-len", "4"), "--output-len has no meaning for --dataset-name burstgpt"),
    (("--input-len", "16", "--random-input-len", "32"), "--input-len 16 conflicts with --random-input-len 32"),
    (("--output-len", "0",), "--output-len must be >= 1"),
])
def test_generic_lengths_are_refused_where_they_mean_nothing(flags, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*flags)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_whose_every_request_fails_exits_non_zero(fake_factory, capsys):
    fake = fake_factory("--ttft-ms", "1", "--itl-ms", "1", "--fail-every", "1", "--fail-status", "503")
    rc = main(["--base-url", fake.url, "--disable-tqdm", "--num-prompts", "4", "--input-len", "16",
               "--output-len", "4", "--no-server-metrics"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "pd-bench: error: every request failed (4 of 4; HTTP 503: 4)" in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_with_some_successes_exits_zero(fake_factory, capsys):
    fake = fake_factory("--ttft-ms", "1", "--itl-ms", "1", "--fail-every", "2")
    rc = main(["--base-url", fake.url, "--disable-tqdm", "--num-prompts", "4", "--input-len", "16",
               "--output-len", "4", "--no-server-metrics"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Successful requests:" in out and "Failed requests:" in out
