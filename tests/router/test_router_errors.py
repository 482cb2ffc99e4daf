"""One OpenAI error format for every 4xx/5xx the router answers, and its OpenAPI document."""

from __future__ import annotations

import httpx
import pytest
from router_testkit import FakeWorker, RouterProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TYPES = {"invalid_request_error", "authentication_error", "permission_error", "rate_limit_error",
         "server_error"}
BODY = {"model": "stories260K", "prompt": "a b", "max_tokens": 2}
DEEP = b"{\"prompt\": " + b"[" * 2000 + b"]" * 2000 + b"}"  # past the JSON parser's recursion limit

# (method, path, kwargs, status, type, param, code)
CASES = [
    ("GET", "/no/such/route", {}, 404, "invalid_request_error", None, "not_found"),
    ("GET", "/v1/completions", {}, 405, "invalid_request_error", None, "method_not_allowed"),
    ("DELETE", "/health", {}, 405, "invalid_request_error", None, "method_not_allowed"),
    ("POST", "/v1/completions", {"content": b'{"prompt": '}, 400, "invalid_request_error", None,
     "invalid_json"),
    ("POST", "/v1/completions", {"content": DEEP}, 400, "invalid_request_error", None,
     "invalid_json"),
    ("POST", "/v1/completions", {"content": b"[1, 2]"}, 400, "invalid_request_error", None,
     "invalid_json"),
    ("POST", "/v1/completions", {"json": {"model": "stories260K"}}, 400, "invalid_request_error",
     "prompt", "missing_required_parameter"),
    ("POST", "/v1/completions", {"json": {**BODY, "stream": "yes"}}, 400,
     "invalid_request_error", "stream", "invalid_value"),
    ("POST", "/v1/chat/completions", {"json": {"model": "stories260K", "messages": "hi"}}, 400,
     "invalid_request_error", "messages", "invalid_value"),
    ("POST", "/v1/completions", {"json": {**BODY, "model": "gpt-9"}}, 404,
     "invalid_request_error", "model", "model_not_found"),
    # 9 prompts x 128 sequences: past what a worker generates for one request, refused before admission (the
    # fake workers accept anything, so the router answers this one)
    ("POST", "/v1/completions", {"json": {**BODY, "prompt": ["a"] * 9, "n": 128}}, 400,
     "invalid_request_error", "prompt", "invalid_value"),
    ("POST", "/v1/completions", {"json": {**BODY, "prompt": "x " * 5000}}, 413,
     "invalid_request_error", None, "request_too_large"),
    ("POST", "/workers", {"json": {"url": "ftp://x:1", "role": "decode"}}, 400,
     "invalid_request_error", None, "invalid_value"),
    ("POST", "/workers", {"json": {"url": "http://x:1"}}, 400, "invalid_request_error", "role",
     "invalid_value"),
    ("DELETE", "/workers", {"params": {"url": "http://nobody:1"}}, 404, "invalid_request_error",
     None, "not_found"),
]


@pytest.fixture(scope="module")
def router():
    with FakeWorker("prefill") as p, FakeWorker("decode", ["--ttft-ms", "5"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url,
                        "--max-payload-size", "4096"]) as r:
        yield r


@pytest.mark.parametrize("method,path,kwargs,status,kind,param,code", CASES,
                         ids=[f"{c[0]} {c[1]} {c[3]} {c[6]}" for c in CASES])
def test_router_errors_share_one_openai_shape(router, method, path, kwargs, status, kind, param,
                                              code):
    r = httpx.request(method, router.url + path, timeout=10, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (kind, param, code)
    assert err["type"] in TYPES and isinstance(err["message"], str) and err["message"]


def test_wrong_api_key_is_401_in_the_same_shape():
    with FakeWorker("prefill") as p, FakeWorker("decode") as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url, "--api-key", "k"]) as router:
        for path in ("/v1/completions", "/v1/models"):
            method = "POST" if path == "/v1/completions" else "GET"
            r = httpx.request(method, router.url + path, json=BODY,
                              headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["error"]["code"] == "invalid_api_key"


def test_openapi_document_lists_every_route_with_the_error_schema(router):
    doc = httpx.get(router.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/readiness",
            "/metrics", "/workers"} <= set(paths)
    completions = paths["/v1/completions"]["post"]
    assert {"200", "400", "401", "404", "413", "429", "502", "503", "504"} <= \
        set(completions["responses"])
    ref = completions["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    error = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert error["required"] == ["error"]
    body_ref = completions["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request = doc["components"]["schemas"][body_ref.rsplit("/", 1)[1]]
    assert "prompt" in request["required"] and request.get("additionalProperties", True)
