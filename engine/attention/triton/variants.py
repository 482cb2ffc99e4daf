"""Which compiled variant of a Triton kernel a launch needs, and recording the variants a process launches.

Triton compiles one binary per *specialisation* of a kernel's arguments: the
values of its ``tl.constexpr`` parameters, the dtype of each tensor, whether
each pointer is 16-byte aligned, and for every integer not listed in
``do_not_specialize`` whether it equals 1 or is a multiple of 16 (Triton's
documented rules: "Specialization" in its ``jit`` docstring). A variant first
seen while serving compiles right then, for seconds, in the engine thread.

The kernels of this package therefore pass runtime-varying integers (the
request offset ``first_req``, the block-table width, the split count behind
the decode partial buffers' strides) as ``do_not_specialize``; everything else
they take is fixed by the model, the dtypes and the pool layout.
`pd_cluster.engine.graph.warm_up_kernels` runs one step at start-up that
launches every kernel in every variant the server can need, and
`VariantRecorder` lets a test prove that no serving step asks for another.

`variant_of` computes the key with Triton's rules from the launch arguments,
so it works under the interpreter too (which compiles nothing).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton.runtime.interpreter as triton_interpreter
import triton.runtime.jit as triton_jit


@dataclass(frozen=True)
class KernelVariant:
    """One compiled specialisation of a kernel.

    Attributes:
        kernel: the kernel's function name.
        constexprs: (name, value) of its constexpr arguments.
        specialized: (name, class) of the others: ``dtype/aligned|unaligned`` for a
            tensor, ``1`` / ``16`` / ``n`` for an integer (equal to 1, a multiple of 16,
            anything else), ``f`` for a float (never specialised).
    """

    kernel: str
    constexprs: tuple[tuple[str, str], ...]
    specialized: tuple[tuple[str, str], ...]


def _meta(kernel) -> tuple[list[str], set[str], set[str]]:
    """(argument names, constexpr names, do_not_specialize names) of a jitted kernel."""
    fn = kernel.fn
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params]
    constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
    if isinstance(kernel, triton_interpreter.InterpretedFunction):
        dns = kernel.kwargs.get("do_not_specialize") or []
    else:
        dns = kernel.do_not_specialize or []
    dns_names = {names[d] if isinstance(d, int) else d for d in dns}
    return names, constexprs, dns_names


def _int_class(value: int) -> str:
    if value == 1:
        return "1"
    return "16" if value % 16 == 0 else "n"


def variant_of(kernel, args: tuple, kwargs: dict, honour_do_not_specialize: bool = True) -> KernelVariant:
    """The variant a launch ``kernel[grid](*args, **kwargs)`` compiles (launch options such as
    ``num_warps`` are constexprs of the compile too, so they are part of the key).
    ``honour_do_not_specialize=False`` gives what Triton would compile without the annotations."""
    names, constexprs, dns = _meta(kernel)
    if not honour_do_not_specialize:
        dns = set()
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    options = tuple(sorted((k, str(v)) for k, v in kwargs.items() if k not in names and k not in ("grid", "warmup")))
    ce, spec = [], []
    for name in names:
        value = bound.get(name)
        if name in constexprs:
            ce.append((name, str(value)))
        elif isinstance(value, torch.Tensor):
            spec.append((name, f"{value.dtype}/{'aligned' if value.data_ptr() % 16 == 0 else 'unaligned'}"))
        elif isinstance(value, bool) or name in dns:
            spec.append((name, str(value) if isinstance(value, bool) else "dns"))
        elif isinstance(value, int):
            spec.append((name, _int_class(value)))
        else:
            spec.append((name, "f"))
    return KernelVariant(kernel.fn.__name__, tuple(ce) + options, tuple(spec))


class VariantRecorder:
    """Records the variant of every Triton launch while active (interpreted or compiled).

    Use as ``with VariantRecorder() as rec: ...``; then ``rec.variants`` is the set seen, and
    ``rec.unannotated`` the set Triton would have compiled without ``do_not_specialize``.
    """

    def __init__(self) -> None:
        self.variants: set[KernelVariant] = set()
        self.unannotated: set[KernelVariant] = set()
        self.launches = 0

    @contextlib.contextmanager
    def _patched(self) -> Iterator[None]:
        recorder = self
        originals = {cls: cls.run for cls in (triton_interpreter.InterpretedFunction, triton_jit.JITFunction)}

        def wrap(original):
            def run(kernel, *args, **kwargs):
                recorder.variants.add(variant_of(kernel, args, kwargs))
                recorder.unannotated.add(variant_of(kernel, args, kwargs, honour_do_not_specialize=False))
                recorder.launches += 1
                return original(kernel, *args, **kwargs)
            return run

        for cls, original in originals.items():
            cls.run = wrap(original)
        try:
            yield
        finally:
            for cls, original in originals.items():
                cls.run = original

    def __enter__(self) -> "VariantRecorder":
        self._ctx = self._patched()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
