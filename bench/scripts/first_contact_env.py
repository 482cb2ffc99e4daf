"""The environment step of the GPU first contact (`first_contact`): what the machine has, and whether Triton compiles.

Prints a markdown report (into the run's log): ``nvidia-smi``,
Python, torch (and its CUDA), Triton, NIXL and the other packages the workers
import, the C compiler and ``Python.h`` that Triton's launchers need, the
device's properties, and the worker's own start-up self-check
(`pd_cluster.engine.attention.triton.selfcheck.check_triton_runtime`), timed;
and records the versions, the device and the verdicts in its part
(`first_contact_part`: ``info`` and two checks). Exit status 1 when a worker
could not start here (no Triton compile, or a package the workers import is
missing).
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time

# imported by a worker of any role (serving) or by the transfer; missing ones stop pd-serve
WORKER_PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "fastapi", "uvicorn",
                   "pydantic", "httpx", "aiohttp", "prometheus_client", "xgrammar", "nixl", "psutil", "uvloop")


def _run(argv: list[str], timeout: float = 20.0) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return (done.stdout + done.stderr).strip() or f"(no output, exit {done.returncode})"
    except FileNotFoundError:
        return "not found"
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"


def package_versions() -> tuple[list[str], list[str]]:
    """Markdown lines ``name: version (path)`` and the names that failed to import."""
    lines, missing = [], []
    for name in WORKER_PACKAGES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure is the finding
            lines.append(f"- {name}: **import failed**: {type(e).__name__}: {e}")
            missing.append(name)
            continue
        version = getattr(mod, "__version__", None)
        if version is None:
            try:
                from importlib.metadata import version as dist_version
                version = dist_version(name.replace("_", "-"))
            except Exception:  # noqa: BLE001
                version = "?"
        lines.append(f"- {name}: {version} ({os.path.dirname(getattr(mod, '__file__', '') or '')})")
    return lines, missing


def compiler_lines() -> list[str]:
    include = sysconfig.get_paths().get("include") or "?"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return [f"- C compiler: {cc or 'none'}: {_run([cc, '--version']).splitlines()[0] if cc else '-'}",
            f"- Python.h: {'found' if os.path.exists(os.path.join(include, 'Python.h')) else 'MISSING'} in {include}",
            f"- nvcc: {_run(['nvcc', '--version']).splitlines()[-1]}",
            f"- TRITON_CACHE_DIR: {os.environ.get('TRITON_CACHE_DIR', '(default ~/.triton/cache)')}, "
            f"TRITON_INTERPRET: {os.environ.get('TRITON_INTERPRET', '(unset)')}"]


def device_lines() -> list[str]:
    import torch
    lines = [f"- torch CUDA: {torch.version.cuda}, cuda available: {torch.cuda.is_available()}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"- cuda:{i}: {p.name}, capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
                         f"{p.total_memory / 2**30:.1f} GiB, L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
    return lines


def selfcheck_line(device) -> tuple[str, bool]:
    """Run the worker's start-up Triton self-check on `device` (CPU: the interpreter)."""
    t0 = time.perf_counter()
    try:
        from pd_cluster.engine.attention.triton.selfcheck import check_triton_runtime
        check_triton_runtime(device)
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return f"- Triton self-check on {device}: **FAILED** after {time.perf_counter() - t0:.1f} s: {e}", False
    return f"- Triton self-check on {device}: passed in {time.perf_counter() - t0:.2f} s (first compile included)", True


def main(argv: list[str] | None = None) -> int:
    from pd_cluster.bench.scripts.first_contact_part import finish, start_part

    args, part = start_part(argv, "env", __doc__)
    import torch
    device = torch.device("cuda:0") if args.device.type == "cuda" else args.device
    print("# First contact: environment\n")
    print(f"- python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    print(f"- CPUs: {os.cpu_count()}")
    pkg_lines, missing = package_versions()
    print("\n## Packages\n")
    print("\n".join(pkg_lines))
    print("\n## Compiler\n")
    print("\n".join(compiler_lines()))
    print("\n## Device\n")
    dev_lines = device_lines()
    print("\n".join(dev_lines))
    line, ok = selfcheck_line(device)
    print(line)
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit",
                "--format=csv,noheader"])
    print("\n## nvidia-smi\n\n```")
    print(_run(["nvidia-smi"]))
    print(smi)
    print("```", flush=True)
    part.info("python", platform.python_version())
    part.info("platform", platform.platform())
    part.info("cpus", os.cpu_count())
    part.info("packages", [ln[2:].split(" (/")[0] for ln in pkg_lines])  # name: version, without the path
    part.info("device", [ln[2:] for ln in dev_lines])
    part.info("nvidia_smi", smi)
    part.check("the Triton self-check passes on " + str(device), ok, line[2:])
    part.check("every package a worker imports is installed", not missing, ", ".join(missing))
    return finish(part)


if __name__ == "__main__":
    raise SystemExit(main())
