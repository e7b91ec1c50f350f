"""The ``flashinfer`` attention backend plugin: FlashInfer's paged-KV kernels on NVIDIA GPUs
(``pip install 'pagelm[flashinfer]'``). Importing it does not import FlashInfer."""

from pagelm import hookimpl
from pagelm.backends.flashinfer.backend import FlashInferAttentionBackend

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_attention_backends(registry) -> None:
    registry.add(FlashInferAttentionBackend.name, FlashInferAttentionBackend)


__all__ = ["FlashInferAttentionBackend"]
