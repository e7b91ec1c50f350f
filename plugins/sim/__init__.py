"""Policy simulator: replay a request trace through the real scheduler and KV cache manager,
with a cost model standing in for the model (``pagelm simulate``)."""

from pagelm.plugins.sim.cost_model import CostModel
from pagelm.plugins.sim.simulator import SimConfig, SimResult, simulate
from pagelm.plugins.sim.trace import TRACE_KINDS, TraceRequest, load_trace, make_trace, save_trace

__all__ = [
    "TRACE_KINDS",
    "CostModel",
    "SimConfig",
    "SimResult",
    "TraceRequest",
    "load_trace",
    "make_trace",
    "save_trace",
    "simulate",
]
