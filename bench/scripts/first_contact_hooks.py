"""The quantized-kernels step of the GPU first contact (`first_contact`): hooks for benchmark scripts that may not
be on this branch yet.

Each hook names a module of ``pd_cluster.bench.scripts`` (`HOOKS`). When the module is absent the hook is a skip
with that reason. When it is there, in order of preference:

1. its source defines ``first_contact_sections(device, ceilings, smoke) -> list[Section]``
   (`gpu_common.Section`, `gpu_common.Ceilings`): it is imported and called in this process, and each table is
   recorded as it returns;
2. otherwise it is run as ``python -m pd_cluster.bench.scripts.<name>`` (``--smoke`` in a dry run) within its
   share of the step's time; its output goes to the run's log, and the markdown tables it prints (``### title``,
   then a ``| ... |`` table) are recorded as sections. A non-zero exit status or a stop at its share is an error.

``--dry-run`` takes the same paths (a module present runs with ``smoke=True``).
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

from pd_cluster.bench.scripts.first_contact_part import Part, finish, load_ceilings, start_part
from pd_cluster.bench.scripts.gpu_common import Row, Section

PACKAGE = "pd_cluster.bench.scripts"
HOOKS: tuple[tuple[str, str], ...] = (
    ("gpu_quant_gemm", "FP8 and int4 GEMMs against the bf16 matmul rate"),
    ("gpu_quant_moe", "FP8-block and MXFP4 fused MoE"),
)


def sections_from_markdown(text: str) -> list[Section]:
    """The ``### title`` + ``| a | b |`` tables in `text`, as sections (cells as text; ``- `` lines as notes)."""
    out: list[Section] = []
    cur: Section | None = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("### "):
            cur = Section(s[4:].strip(), [])
            out.append(cur)
        elif cur is not None and s.startswith("|") and s.endswith("|"):
            cells = [c.strip() for c in s.strip("|").split("|")]
            if not cur.columns:
                cur.columns = cells
            elif not all(set(c) <= set("-: ") for c in cells):
                cur.rows.append(Row(cells))
        elif cur is not None and s.startswith("- ") and cur.columns:
            cur.notes.append(s[2:])
    return [s for s in out if s.columns]


def run_hook(part: Part, name: str, what: str, device, work, smoke: bool, deadline: float) -> None:
    module = f"{PACKAGE}.{name}"
    spec = importlib.util.find_spec(module)
    if spec is None:
        part.skip(f"{what} ({name})", f"not on this branch: bench/scripts/{name}.py is absent")
        return
    source = Path(spec.origin).read_text(errors="replace") if spec.origin else ""
    if "def first_contact_sections(" in source:  # read, not imported, first: a script may act at import
        fn = importlib.import_module(module).first_contact_sections
        ceil = load_ceilings(work, device, smoke)
        for sec in fn(device, ceil, smoke):
            part.section(sec)
        return
    argv = [sys.executable, "-m", module, *(["--smoke"] if smoke else [])]
    print(f"$ {' '.join(argv)}", flush=True)
    left = deadline - time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=max(1.0, left) if left < 1e9 else None)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out, flush=True)
        for sec in sections_from_markdown(out):
            part.section(sec)
        raise RuntimeError(f"{name} was stopped at its share ({e.timeout:.0f} s)") from None
    print(done.stdout + done.stderr, flush=True)
    for sec in sections_from_markdown(done.stdout):
        part.section(sec)
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited with {done.returncode}: {done.stderr.strip()[-300:]}")


def main(argv: list[str] | None = None) -> int:
    args, part = start_part(argv, "quant", __doc__)
    for i, (name, what) in enumerate(HOOKS):
        share = max(0.0, part.left_s()) / (len(HOOKS) - i)
        with part.guard(f"hook {name}"):
            run_hook(part, name, what, args.device, args.work, args.dry_run, time.monotonic() + share)
    return finish(part)


if __name__ == "__main__":
    sys.exit(main())
