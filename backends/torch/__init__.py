"""The ``torch`` reference attention backend plugin."""

from pagelm import hookimpl
from pagelm.backends.torch.backend import TorchAttentionBackend

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_attention_backends(registry) -> None:
    registry.add(TorchAttentionBackend.name, TorchAttentionBackend)


__all__ = ["TorchAttentionBackend"]
