"""The built-in Triton kernels behind the core's fused ops, the sampler and the decode graphs,
registered by name (``pagelm.kernels``). Importing this plugin does not import Triton:
each kernel module is imported when its kernel is first called (on CUDA; on the CPU only
under ``TRITON_INTERPRET=1``, in tests)."""

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"

_KERNELS = {
    "rms_norm": "rms_norm:rms_norm",
    "rotary_embedding": "rotary:rotary_embedding",
    "silu_and_mul": "activation:silu_and_mul",
    "gemv": "gemv:gemv",
    "apply_token_bitmask": "bitmask:apply_token_bitmask_triton",
    "exponential_race": "race:exponential_race_triton",
    "derive_step_inputs": "graph_inputs:derive_step_inputs",
    "draft_step_inputs": "draft_inputs:draft_step_inputs",
    "draft_pass_inputs": "draft_inputs:draft_pass_inputs",
    "gather_drafts": "draft_inputs:gather_drafts",
}


@hookimpl
def pagelm_register_kernels(registry) -> None:
    for name, ref in _KERNELS.items():
        registry.add(name, f"{__name__}.{ref}")
