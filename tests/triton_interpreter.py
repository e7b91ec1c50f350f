"""Running Triton kernels on the CPU under ``TRITON_INTERPRET=1``, for tests.

TRITON_INTERPRET is read when a kernel is decorated, so it must be set before the kernel
modules are first imported; and torch imports Triton (through torch._dynamo) long before any
test runs, so triton.language's own jit helpers (tl.max, tl.sum, tl.cdiv...) were built for
the compiler and refuse to run inside an interpreted kernel. :func:`interpret_triton` fixes
both for the life of a monkeypatch context. :func:`interpreted_kernels` runs a block with
given kernel modules imported under it (on CUDA: as they are).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType


def interpret_triton(mp) -> None:
    """Set TRITON_INTERPRET=1 and rebuild triton.language's jit helpers for the interpreter,
    as if it had been set before Triton was first imported. ``mp`` is a
    ``pytest.MonkeyPatch``: leaving its context undoes both."""
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    mp.setenv("TRITON_INTERPRET", "1")
    # The interpreter checks every integer add and multiply for int32 overflow (a compiled
    # kernel does only with debug=True): a third of an interpreted paged-attention run, and
    # test shapes index far below 2**31.
    mp.setattr(
        interpreter.interpreter_builder, "options",
        dataclasses.replace(interpreter.interpreter_builder.options, sanitize_overflow=False),
    )
    rebuilt = {}
    for module in (tl.standard, tl):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in rebuilt:
                    rebuilt[id(value)] = InterpretedFunction(value.fn)
                mp.setattr(module, name, rebuilt[id(value)])


@contextmanager
def interpreted_kernels(*module_names: str, fresh: bool = False) -> Iterator[list[ModuleType]]:
    """The kernel modules ``module_names``, decorated for the CPU interpreter for the block
    (on a CUDA machine: imported as they are). They must not have been imported before,
    unless ``fresh``: then a new copy is imported for the block and dropped after it, so that
    no interpreted build is left behind for later tests."""
    import pytest
    import torch

    if torch.cuda.is_available():
        yield [importlib.import_module(name) for name in module_names]
        return
    with pytest.MonkeyPatch.context() as mp:
        interpret_triton(mp)
        for name in module_names:
            if fresh:
                mp.delitem(sys.modules, name, raising=False)
        modules = [importlib.import_module(name) for name in module_names]
        for name, module in zip(module_names, modules):
            assert getattr(module, "INTERPRETED", True), f"{name} was imported before TRITON_INTERPRET was set"
        yield modules
    if fresh:
        for name, module in zip(module_names, modules):
            if sys.modules.get(name) is module:
                del sys.modules[name]
