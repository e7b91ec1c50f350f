"""GPU test helpers."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def forbid_host_sync():
    """Every synchronising CUDA call inside raises (``torch.cuda.set_sync_debug_mode("error")``),
    except the runner's deliberately marked reads (``pagelm.worker.step_state.host_sync_point``)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
