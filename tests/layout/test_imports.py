"""Layer contracts over the source tree, read with `ast` (no imports are executed).

* every import of a project module goes through the one namespace, ``pd_cluster``;
* `common` imports no other package of ours, and nothing outside the standard library;
* the engine imports no web, HTTP or metrics library, and no serving, role, router or transfer code (only `common`);
* no tool-call code under `engine/` (it is in `serving/tools/`);
* the prefill and decode roles never import each other; what they share beyond `serving` is in `disagg`;
* the router, the transfer and the planner import nothing of ours but `common` (no engine, no serving, no role);
* the package folders form no cycle, and neither do the files (imports inside functions and under
  `TYPE_CHECKING` count too).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ["common", "engine", "serving", "disagg", "prefill", "decode", "router", "transfer", "bench", "launch",
           "planner"]
WEB_AND_METRICS = {"fastapi", "starlette", "pydantic", "prometheus_client", "httpx", "aiohttp", "uvicorn"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["pd_cluster", *parts])


@functools.lru_cache(maxsize=None)
def _imports(path: Path) -> tuple[str, ...]:
    """Absolute module names imported by one file (``from a import b`` gives ``a`` and ``a.b``); each file is
    parsed once per session (the tests below read the same files)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; use pd_cluster.* names"
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return tuple(names)


def _sources(*folders: str) -> list[Path]:
    out = []
    for folder in folders or FOLDERS:
        out += [p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts]
    return out


def _is_module(dotted: str) -> bool:
    parts = dotted.split(".")[1:]
    p = REPO.joinpath(*parts) if parts else REPO
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def test_every_project_import_uses_the_namespace():
    bad = []
    for path in _sources() + list((REPO / "tests").rglob("*.py")):
        for name in _imports(path):
            if name.split(".")[0] in FOLDERS:
                bad.append(f"{path.relative_to(REPO)}: {name}")
    assert not bad, "imports outside pd_cluster.*:\n" + "\n".join(bad)


def test_engine_imports_no_web_metrics_serving_or_role_code():
    bad = []
    for path in _sources("engine"):
        for name in _imports(path):
            top = name.split(".")[0]
            second = name.split(".")[1] if name.startswith("pd_cluster.") and "." in name else None
            if top in WEB_AND_METRICS or (second and second not in ("engine", "common")):
                bad.append(f"{path.relative_to(REPO)}: {name}")
    assert not bad, "the engine must stay pure model execution:\n" + "\n".join(bad)


def test_no_tool_call_code_in_the_engine():
    """OpenAI tool calls are the server's (`serving/tools/`); the engine sees only the `StructuredOutput` a forced
    call becomes. No engine module is named for tools, and none handles tool calls or ``tool_choice``."""
    named = [str(p.relative_to(REPO)) for p in _sources("engine") if "tool" in p.stem]
    assert not named, f"tool-call modules under engine/: {named}"
    mentions = [str(p.relative_to(REPO)) for p in _sources("engine")
                if re.search(r"tool_call|tool_choice|ToolCall|tool_parser", p.read_text())]
    assert not mentions, f"engine modules handling tool calls: {mentions}"


def test_common_is_below_everything():
    """`common` is the bottom layer: the standard library only (the router and ``pd-bench`` load it without torch)."""
    stdlib = sys.stdlib_module_names
    bad = [f"{p.relative_to(REPO)}: {n}" for p in _sources("common") for n in _imports(p)
           if not n.startswith("pd_cluster.common") and n.split(".")[0] not in stdlib and n != "__future__"]
    assert not bad, "common must import only the standard library and itself:\n" + "\n".join(bad)


@pytest.mark.parametrize("role,other", [("prefill", "decode"), ("decode", "prefill")])
def test_roles_do_not_import_each_other(role, other):
    bad = [f"{p.relative_to(REPO)}: {n}" for p in _sources(role) for n in _imports(p)
           if n == f"pd_cluster.{other}" or n.startswith(f"pd_cluster.{other}.")]
    assert not bad, f"{role} imports {other}:\n" + "\n".join(bad)


def test_the_roles_share_through_disagg_which_imports_neither():
    bad = [f"{p.relative_to(REPO)}: {n}" for p in _sources("disagg") for n in _imports(p)
           if n.startswith("pd_cluster.") and n.split(".")[1] in ("prefill", "decode", "launch", "bench", "router")]
    assert not bad, "disagg/ is below both roles:\n" + "\n".join(bad)


@pytest.mark.parametrize("lower", ["transfer", "router", "planner"])
def test_router_and_transfer_import_nothing_of_ours_but_common(lower):
    """No import of the engine (nor serving, the roles, launch, bench) from router/, transfer/ or planner/."""
    bad = [f"{p.relative_to(REPO)}: {n}" for p in _sources(lower) for n in _imports(p)
           if n.startswith("pd_cluster.") and n.split(".")[1] not in (lower, "common")]
    assert not bad, f"{lower}/ may import only pd_cluster.common:\n" + "\n".join(bad)


def _package_of(module: str) -> str:
    """The folder (package) a module lives in: ``pd_cluster.engine.kv.pool`` -> ``pd_cluster.engine.kv``."""
    parts = module.split(".")
    p = REPO.joinpath(*parts[1:])
    return module if (p / "__init__.py").is_file() else ".".join(parts[:-1])


def _folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in _sources():
        src = _package_of(_module_name(path))
        for name in _imports(path):
            if not name.startswith("pd_cluster."):
                continue
            while name and not _is_module(name):
                name = name.rpartition(".")[0]
            dst = _package_of(name)
            # a folder may use its own parents' __init__ re-exports without forming a folder cycle
            if dst != src and not src.startswith(dst + "."):
                graph[src].add(dst)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_folder_cycles():
    cycle = _find_cycle(_folder_graph())
    assert cycle is None, "folder import cycle: " + " -> ".join(cycle)


def _module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in _sources():
        src = _module_name(path)
        for name in _imports(path):
            if not name.startswith("pd_cluster."):
                continue
            while name and not _is_module(name):
                name = name.rpartition(".")[0]
            if name and name != src:
                graph[src].add(name)
    return graph


def test_no_file_cycles():
    """No module reaches itself through its imports: every import inside a function or under `TYPE_CHECKING`
    counts, since either is a tie that runs both ways."""
    cycle = _find_cycle(_module_graph())
    assert cycle is None, "file import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None
