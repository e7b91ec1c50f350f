"""The ``triton`` attention backend plugin: paged attention in Triton kernels (CUDA; CPU
only under ``TRITON_INTERPRET=1``). Importing it does not import Triton."""

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"
from pagelm.backends.triton.backend import TritonAttentionBackend


@hookimpl
def pagelm_register_attention_backends(registry) -> None:
    registry.add(TritonAttentionBackend.name, TritonAttentionBackend)


__all__ = ["TritonAttentionBackend"]
