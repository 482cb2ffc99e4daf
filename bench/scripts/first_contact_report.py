"""The results of a GPU first contact (`first_contact`): the steps' parts merged into one JSON and one markdown
file, rewritten after every step (and while a step runs), so that a run cut short keeps what it measured.

``results.json``: ``run`` (command, start, budget, time used, dry run), ``steps`` (status, budget, share, wall time,
what ended each command), and every part's ``targets``, ``checks``, ``skips`` and ``errors`` gathered with their
step's name, then ``parts`` (each step's part whole: its tables and ``info``).

``results.md``: the same as tables: environment, steps, targets (met or MISSED, with the top kernels of each
miss), checks, skips and errors, then each step's tables in step order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pd_cluster.bench.scripts.gpu_common import Row, Section


def read_part(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write by a reader without os.replace
        return None


def gather(parts: dict[str, dict]) -> dict[str, list]:
    """Every part's targets, checks, skips and errors, each row with its step's name."""
    out: dict[str, list] = {"targets": [], "checks": [], "skips": [], "errors": []}
    for step, part in parts.items():
        for key in out:
            out[key] += [{"step": step, **row} for row in part.get(key, [])]
    return out


def write(out: Path, run: dict, steps: list[dict], parts: dict[str, dict]) -> None:
    """Rewrite ``results.json`` and ``results.md`` in `out` (atomically)."""
    data = {"run": run, "steps": steps, **gather(parts), "parts": parts}
    _atomic(out / "results.json", json.dumps(data, indent=1, default=str))
    _atomic(out / "results.md", markdown(data))


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cell(v) -> str:
    text = (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}") if isinstance(v, float) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]


def _verdict(t: dict) -> str:
    return {True: "met", False: "**MISSED**", None: "not measured"}[t["met"]]


def markdown(data: dict, summary_only: bool = False) -> str:
    """The results as markdown; with `summary_only`, without the steps' own tables."""
    run = data["run"]
    lines = ["# GPU first contact: results", "",
             f"- started {run['started']}; command: `{run['command']}`",
             f"- budget {run['budget_s']:.0f} s, used {run['used_s']:.0f} s"
             + (" — **dry run: toy sizes on CPU, the numbers mean nothing**" if run["dry_run"] else "")]
    env = data["parts"].get("env", {}).get("info", {})
    for key in ("device", "nvidia_smi", "packages"):
        if env.get(key):
            value = env[key] if isinstance(env[key], str) else "; ".join(env[key])
            lines.append(f"- {key}: {value}")
    ucx = data["parts"].get("nixl", {}).get("info", {}).get("ucx")
    if ucx:
        lines.append(f"- UCX: {', '.join(ucx)}")
    lines += ["", "## Steps", ""]
    lines += _table(["step", "what", "status", "budget (s)", "share (s)", "wall (s)", "detail"],
                    [[s["name"], s["what"], s["status"], s["budget_s"], s["share_s"], s["wall_s"], s["detail"]]
                     for s in data["steps"]])
    lines += ["", "## Targets", ""]
    lines += _table(["step", "target", "where", "measured", "bound", "verdict"],
                    [[t["step"], t["metric"], t["where"], t["measured"] if t["measured"] is not None else "-",
                      f"{t['op']} {t['bound']:g} {t['unit']}", _verdict(t)] for t in data["targets"]])
    for t in data["targets"]:
        if t["met"] is False:
            lines.append(f"- missed, {t['metric']} ({t['where']}): {t['note']}".rstrip(": ")
                         + ("; top kernels (torch.profiler): " + "; ".join(t["top_kernels"])
                            if t["top_kernels"] else ""))
    if data["checks"]:
        lines += ["", "## Checks", ""]
        lines += _table(["step", "check", "verdict", "detail"],
                        [[c["step"], c["what"], "pass" if c["passed"] else "**FAIL**", c["detail"]]
                         for c in data["checks"]])
    if data["skips"]:
        lines += ["", "## Not run", ""]
        lines += _table(["step", "what", "reason"], [[s["step"], s["what"], s["reason"]] for s in data["skips"]])
    if data["errors"]:
        lines += ["", "## Errors", ""]
        lines += _table(["step", "what", "error"], [[e["step"], e["what"], e["error"]] for e in data["errors"]])
    for s in [] if summary_only else data["steps"]:
        part = data["parts"].get(s["name"])
        if part and part.get("sections"):
            lines += ["", f"## {s['name']}: {s['what']}", ""]
            for sec in part["sections"]:
                rows = [Row(r["cells"], r.get("note", "")) for r in sec["rows"]]
                lines.append(Section(sec["title"], sec["columns"], rows, sec["notes"]).markdown())
    return "\n".join(lines) + "\n"
