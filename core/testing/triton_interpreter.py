"""Running Triton kernels on the CPU under ``TRITON_INTERPRET=1``, for tests.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before the kernel
modules are first imported; and torch imports Triton (through torch._dynamo) long before any
test runs, so triton.language's own jit helpers (tl.max, tl.sum, tl.cdiv...) were built for
the compiler and refuse to run inside an interpreted kernel. :func:`interpret_triton` fixes
both for the life of a monkeypatch context.
"""

from __future__ import annotations


def interpret_triton(mp) -> None:
    """Set TRITON_INTERPRET=1 and rebuild triton.language's jit helpers for the interpreter,
    as if it had been set before Triton was first imported. ``mp`` is a
    ``pytest.MonkeyPatch``: leaving its context undoes both."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    mp.setenv("TRITON_INTERPRET", "1")
    rebuilt = {}
    for module in (tl.standard, tl):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in rebuilt:
                    rebuilt[id(value)] = InterpretedFunction(value.fn)
                mp.setattr(module, name, rebuilt[id(value)])
