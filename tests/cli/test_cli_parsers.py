"""Command lines: no abbreviations anywhere, the vLLM/SGLang spellings users paste, one flag table, WorkerConfig."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import sys
import tomllib
from pathlib import Path

import pytest

from pd_cluster.engine.args import add_engine_args, config_from_args, config_from_kwargs
from pd_cluster.launch import serve as launch_serve
from pd_cluster.launch import worker as launch_worker
from pd_cluster.serving.worker_app import WorkerConfig
from pd_cluster.transfer.config import TRANSFER_FLAGS, TransferConfig, add_cli_args, from_cli_args

REPO = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ["engine", "serving", "prefill", "decode", "router", "transfer", "bench", "launch"]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _entry_points() -> dict[str, str]:
    """Console scripts of pyproject.toml (name -> module:function), plus the fake server's module entry point."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return dict(scripts, **{"python -m pd_cluster.bench.fake_server": "pd_cluster.bench.fake_server:main"})


def _parser_of(target: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser an entry point really builds: run it until it parses, and stop it there."""
    module, func = target.split(":")
    main = getattr(importlib.import_module(module), func)

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(sys, "argv", [module])
    with pytest.raises(_Captured) as caught:
        main([]) if inspect.signature(main).parameters else main()
    return caught.value.parser


@pytest.mark.parametrize("name,target", sorted(_entry_points().items()))
def test_every_console_script_parser_refuses_abbreviations(name, target, monkeypatch):
    parser = _parser_of(target, monkeypatch)
    assert parser.allow_abbrev is False, name


def test_every_argument_parser_in_the_source_tree_sets_allow_abbrev_false():
    """Every ``ArgumentParser(...)`` call in the product (bench scripts included) passes allow_abbrev=False."""
    bad, seen = [], 0
    for folder in SOURCE_FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            if "ArgumentParser" not in text:  # no such call can be in it: parse only the files that name it
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) \
                        == "ArgumentParser":
                    seen += 1
                    kw = {k.arg: k.value for k in node.keywords}
                    if not (isinstance(kw.get("allow_abbrev"), ast.Constant) and kw["allow_abbrev"].value is False):
                        bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert seen >= 10 and not bad, bad


def _parse_error(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    return err.getvalue()


def test_pd_bench_input_len_is_not_read_as_input_len_scale(monkeypatch):
    """vLLM's ``--input-len 16`` once silently meant ``--input-len-scale 16`` through abbreviation."""
    parser = _parser_of(_entry_points()["pd-bench"], monkeypatch)
    monkeypatch.undo()
    try:
        ns = parser.parse_args(["--input-len", "16", "--output-len", "4"])
    except SystemExit:
        return  # refused: what pd-bench does today
    assert ns.input_len_scale == 1.0 and ns.output_len_scale == 1.0  # or it means what vLLM means


@pytest.mark.parametrize("argv", [["--page-siz", "16"], ["--kv-transfer-time", "5"], ["--model-pa", "x"]])
def test_pd_worker_refuses_prefixes(argv):
    assert "unrecognized arguments" in _parse_error(launch_worker.build_parser(), argv)


def test_pd_router_refuses_prefixes():
    from pd_cluster.router.args import build_parser

    assert "unrecognized arguments" in _parse_error(build_parser(), ["--prefill-pol", "random"])


# ---- vLLM / SGLang spellings -------------------------------------------------------------------
@pytest.mark.parametrize("alias,ours,value,field", [
    ("--model-path", "--model", "/models/llama", ("model", "model")),          # SGLang
    ("--tokenizer-path", "--tokenizer", "/models/tok", ("model", "tokenizer")),  # SGLang
    ("--max-model-len", "--context-length", "512", ("scheduler", "context_length")),  # vLLM
    ("--random-seed", "--seed", "7", ("model", "seed")),                        # SGLang
    ("--tensor-parallel-size", "--tp-size", "1", ("parallel", "tp_size")),     # both
])
def test_aliases_build_the_same_engine_config(alias, ours, value, field):
    parser = launch_worker.build_parser()
    by_alias = config_from_args(parser.parse_args([alias, value]))
    by_ours = config_from_args(parser.parse_args([ours, value]))
    assert by_alias == by_ours
    section, name = field
    assert str(getattr(getattr(by_alias, section), name)) == value


def test_trust_remote_code_is_accepted_and_changes_nothing():
    parser = launch_worker.build_parser()
    ns = parser.parse_args(["--trust-remote-code"])
    assert ns.trust_remote_code is True
    assert config_from_args(ns) == config_from_args(parser.parse_args([]))
    assert config_from_kwargs(trust_remote_code=True) == config_from_kwargs()


def test_a_flag_whose_meaning_differs_is_refused_with_the_flag_to_use():
    msg = _parse_error(launch_worker.build_parser(), ["--gpu-memory-utilization", "0.9"])
    assert "--gpu-memory-utilization is not supported" in msg and "--mem-fraction-static" in msg


def test_pd_serve_passes_aliases_to_workers_under_our_names():
    parser = launch_serve.build_parser()
    args = parser.parse_args(["--max-model-len", "300", "--random-seed", "5", "--kv-transfer-timeout", "12",
                              "--no-kv-transfer-hugepages"])
    argv = launch_serve.passthrough_argv(args, parser)
    assert argv == ["--seed", "5", "--context-length", "300", "--kv-transfer-timeout", "12.0",
                    "--no-kv-transfer-hugepages"]
    worker = launch_worker.worker_config_from_args(launch_worker.build_parser().parse_args(argv))
    assert worker.engine.scheduler.context_length == 300 and worker.transfer.kv_transfer_timeout == 12.0


def test_pd_serve_takes_the_keys_itself():
    args = launch_serve.build_parser().parse_args(["--api-key", "K", "--admin-api-key", "A"])
    assert (args.api_key, args.admin_api_key) == ("K", "A")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        launch_serve.main(["--router-arg=--api-key=K"])
    assert "give --api-key to pd-serve itself" in err.getvalue()


def test_pd_serve_router_logs_text_like_the_workers_unless_asked():
    parse = launch_serve.build_parser().parse_args
    assert launch_serve.router_argv_of(parse([]))[:2] == ["--log-format", "text"]
    argv = launch_serve.router_argv_of(parse(["--log-format", "json", "--shutdown-grace-period-secs", "3",
                                              "--router-arg=--prefill-policy=cache_aware"]))
    assert argv == ["--log-format", "json", "--shutdown-grace-period-secs", "3.0", "--prefill-policy=cache_aware"]
    argv = launch_serve.router_argv_of(parse(["--max-prompts-per-request", "64"]))
    assert argv == ["--log-format", "text", "--max-prompts-per-request", "64"]  # the router's flag, passed on


def test_pd_serve_knows_the_router_grace_period_it_waits_for():
    assert launch_serve.router_grace_period([]) == 180.0
    assert launch_serve.router_grace_period(["--shutdown-grace-period-secs", "5"]) == 5.0
    assert launch_serve.router_grace_period(["--shutdown-grace-period-secs=7", "--shutdown-grace-period-secs=2"]) == 2.0
    with pytest.raises(ValueError, match="not a number"):
        launch_serve.router_grace_period(["--shutdown-grace-period-secs", "soon"])


# ---- one flag table ------------------------------------------------------------------------------
def test_transfer_defaults_are_the_config_defaults():
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_cli_args(p)
    assert from_cli_args(p.parse_args([])) == TransferConfig()
    for flag in TRANSFER_FLAGS:  # each default is read from the dataclass field of its row
        field = next(f for f in dataclasses.fields(TransferConfig) if f.name == flag.field)
        assert p.get_default(flag.dest) == field.default, flag.name
    c = from_cli_args(p.parse_args(["--kv-transfer-timeout", "0.5", "--kv-transfer-ucx-tls", "tcp"]))
    assert (c.kv_transfer_timeout, c.heartbeat_interval, c.ucx_tls) == (0.5, 0.5, "tcp")  # heartbeat capped


def test_engine_flags_default_to_none_so_the_config_defaults_apply():
    p = add_engine_args(argparse.ArgumentParser(allow_abbrev=False))
    assert config_from_args(p.parse_args([])) == config_from_kwargs()


# ---- WorkerConfig --------------------------------------------------------------------------------
def test_worker_config_is_frozen_typed_and_complete():
    ns = launch_worker.build_parser().parse_args([
        "--disaggregation-mode", "decode", "--host", "0.0.0.0", "--port", "31000", "--prefill-url",
        "http://p:1", "--page-size", "16", "--kv-transfer-timeout", "9"])
    cfg = launch_worker.worker_config_from_args(ns)
    assert (cfg.role, cfg.engine.role, cfg.url, cfg.prefill_url) == ("decode", "decode", "http://0.0.0.0:31000",
                                                                      "http://p:1")
    assert cfg.engine.cache.page_size == 16 and cfg.transfer.kv_transfer_timeout == 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="role"):
        dataclasses.replace(cfg, role="prefill")  # the engine's role disagrees
    with pytest.raises(ValueError, match="prefill_url"):
        launch_worker.worker_config_from_args(launch_worker.build_parser().parse_args(
            ["--role", "prefill", "--prefill-url", "http://p:1"]))


def test_the_three_role_apps_have_one_signature():
    from pd_cluster.launch.worker import role_app_builder

    builders = [role_app_builder(role) for role in ("mixed", "prefill", "decode")]
    assert [b.__name__ for b in builders] == ["build_mixed_app", "build_prefill_app", "build_decode_app"]
    signatures = [[(p.name, p.annotation, p.default) for p in inspect.signature(b).parameters.values()]
                  for b in builders]
    assert signatures[0] == signatures[1] == signatures[2], signatures
    assert [name for name, _, _ in signatures[0]] == ["engine", "config", "host_info", "exit_on_fatal"]
    assert signatures[0][1][1] in (WorkerConfig, "WorkerConfig")


def test_pd_bench_plot_without_matplotlib_says_which_extra_to_install(monkeypatch):
    import importlib.util

    from pd_cluster.bench.args import build_parser as bench_parser, to_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'pd-cluster\[plot\]'"):
        to_config(bench_parser().parse_args(["--plot"]))
