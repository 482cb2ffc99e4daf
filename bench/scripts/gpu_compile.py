"""Compile the attention kernels for Hopper (sm_90) without a GPU and report what the SASS holds.

Triton's wheel carries ``ptxas`` and ``cuobjdump``, so the kernels can be
compiled ahead of time for a GPU target on any machine. For each kernel at
Llama-3.1-8B's serving shapes (bf16 activations, FP8 pages, page 64) this
prints registers, local memory (spills), shared memory, and counts of the
instructions that matter (global loads and their width, tensor-core ops,
byte-wise shared loads, conversions), following the device guide's advice to
read the compiler's report and the disassembly before spending device time.

Run: ``TRITON_INTERPRET=0 python -m pd_cluster.bench.scripts.gpu_compile`` (prints a table).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # compile, never interpret; before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

WATCH = ("LDG.E.128", "LDG.E.64", "LDG.E", "LDGSTS.E.BYPASS.128", "LDGSTS.E.128", "LDGSTS.E.64", "LDS.U8",
         "HGMMA", "HMMA", "F2F.BF16.F16", "F2FP.F16.E4M3.UNPACK_B", "LDL", "STL")


def compile_sm90(fn, types: dict, const: dict, no_div16=(), num_warps: int = 4, num_stages: int = 2) -> dict:
    """Compile `fn` for sm_90 with 16-byte alignment hints like the JIT's (pointers, strides) and read its SASS."""
    names = fn.arg_names
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in names}
    div = [n for n in names
           if n not in const and n not in no_div16 and (sig[n].startswith("*") or n.startswith("stride"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True).stdout
    ops = Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", sass))
    watch = {w: sum(c for op, c in ops.items() if op == w or (w in ("HGMMA", "HMMA") and op.startswith(w)))
             for w in WATCH}
    def field(name: str) -> int:
        m = re.search(name + r":(\d+)", usage)
        return int(m.group(1)) if m else -1
    return dict(regs=field("REG"), stack=field("STACK"), local=field("LOCAL"), shared=k.metadata.shared,
                instructions=sum(ops.values()), watch=watch)


def kernels():
    from pd_cluster.engine.attention.triton import decode, extend, store
    dec_types = dict(Q="*bf16", K_cache="*fp8e4nv", V_cache="*fp8e4nv", block_tables="*i32", seq_lens="*i32",
                     num_splits="*i32", Mid_O="*fp32", Mid_LSE="*fp32", qk_scale="fp32")
    for bn, nw, ns in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 2), (32, 4, 3)):
        const = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=64, BLOCK_N=bn,
                     PAGE_ALIGNED=64 % bn == 0, SLIDING_WINDOW=0, COMPUTE=tl.float16, DOT_PRECISION="tf32",
                     CLAMP_Q=True)
        yield (f"decode stage 1, block_n={bn}", nw, ns, decode._decode_stage1_kernel, dec_types, const,
               ("stride_bt", "stride_ml_h", "stride_ml_b"))
    yield ("decode stage 2", 2, 1, decode._decode_stage2_kernel,
           dict(Mid_O="*fp32", Mid_LSE="*fp32", num_splits="*i32", O="*bf16", v_scale="fp32"),
           dict(HEAD_DIM=128, BLOCK_D=128), ("stride_ml_h", "stride_ml_b"))
    ext_types = dict(Q="*bf16", K_cache="*fp8e4nv", V_cache="*fp8e4nv", O="*bf16", block_tables="*i32",
                     seq_lens="*i32", query_start_loc="*i32", first_req="i32", qk_scale="fp32", v_scale="fp32")
    for bm, bn, nw, ns in ((128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
        const = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=64, BLOCK_M=bm, BLOCK_N=bn,
                     PAGE_ALIGNED=64 % bn == 0, SLIDING_WINDOW=0, COMPUTE=tl.float16, DOT_PRECISION="tf32",
                     CLAMP_Q=True)
        yield (f"extend {bm}x{bn}", nw, ns, extend._extend_kernel, ext_types, const, ("stride_bt", "first_req"))
    yield ("store (FP8, 8 KV heads)", 4, 1, store._store_kv_kernel,
           dict(K="*bf16", V="*bf16", K_cache="*fp8e4nv", V_cache="*fp8e4nv", slot_mapping="*i64",
                k_scale="fp32", v_scale="fp32"),
           dict(NUM_KV_HEADS=8, BLOCK_HKV=8, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=64, IS_FP8=True,
                APPLY_K_SCALE=True, APPLY_V_SCALE=True), ())


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it (or set 0) to compile", file=sys.stderr)
        return 2
    cols = ["kernel", "warps", "stages", "regs", "stack B", "local B", "smem B", "instr"] + list(WATCH)
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for name, nw, ns, fn, types, const, nodiv in kernels():
        r = compile_sm90(fn, types, const, nodiv, nw, ns)
        cells = [name, nw, ns, r["regs"], r["stack"], r["local"], r["shared"], r["instructions"]] + [r["watch"][w] for w in WATCH]
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
    print(f"\nsm_90 SASS from triton {triton.__version__}'s ptxas; static counts (a pipelined loop appears "
          "more than once), bf16 activations over FP8 pages, head_dim 128, page 64.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
