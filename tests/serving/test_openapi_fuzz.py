"""A bounded schemathesis run against a mixed worker's ``/openapi.json`` (issue 12): no server error, no response
that breaks the document, every status documented."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_kit import running_worker  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance")


def min_tokens_kills_the_engine() -> bool:
    """True while the engine's `min_tokens` bug (issue 12 finding 1) is unfixed: the fuzzer must not send it."""
    from pd_cluster.engine.llm import LLM
    from pd_cluster.engine.sampling.params import SamplingParams

    llm = LLM(kv_cache_memory="16MiB", cpu_threads=1)
    try:
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, min_tokens=2, temperature=0))
        return False
    except RuntimeError:
        return True
    finally:
        llm.engine.close()


@pytest.mark.timeout(180)
def test_schemathesis_finds_no_server_error_and_no_schema_break(tmp_path):
    st = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    with running_worker() as w:
        doc = httpx.get(w.url + "/openapi.json", timeout=10).json()
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
                "/version"} <= set(doc["paths"])
        if min_tokens_kills_the_engine():
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                doc["components"]["schemas"][name]["properties"]["min_tokens"] = {"const": 0}
        (tmp_path / "openapi.json").write_text(json.dumps(doc))
        proc = subprocess.run(
            [st, "run", str(tmp_path / "openapi.json"), "--url", w.url, "--checks", CHECKS,
             "--phases", "coverage,fuzzing", "--max-examples", "5", "--max-time", "40", "--seed", "7",
             "--workers", "1", "--request-timeout", "30", "--generation-database", "none", "--no-color",
             "--output-sanitize", "false", "--suppress-health-check", "all"],
            cwd=tmp_path, capture_output=True, text=True, timeout=150)
        out = proc.stdout + proc.stderr
        print(out[-1500:])
        assert proc.returncode == 0, out[-6000:]
        assert "failures" not in out.split("SUMMARY")[-1].lower() or " 0 failures" in out, out[-3000:]
        assert httpx.get(w.url + "/health", timeout=5).status_code == 200  # nothing took the worker down
