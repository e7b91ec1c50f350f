"""The built-in model architectures and model loaders, registered through the same hooks as
third-party ones; EAGLE draft heads are registered as ``Eagle<architecture>``."""

from pagelm import hookimpl
from pagelm.models.eagle import EAGLE_HEADS
from pagelm.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagelm.models.llava import LlavaForConditionalGeneration
from pagelm.models.loader import DummyLoader, SafetensorsLoader
from pagelm.models.qwen2 import Qwen2ForCausalLM
from pagelm.models.qwen2_vl import Qwen2VLForConditionalGeneration
from pagelm.models.qwen3 import Qwen3ForCausalLM

PAGELM_PLUGIN_API = "2.25"

__all__ = [
    "LlamaForCausalLM", "LlavaForConditionalGeneration", "MistralForCausalLM", "Qwen2ForCausalLM",
    "Qwen2VLForConditionalGeneration", "Qwen3ForCausalLM",
]


@hookimpl
def pagelm_register_models(registry) -> None:
    for cls in (
        LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, LlavaForConditionalGeneration,
        Qwen2VLForConditionalGeneration, *EAGLE_HEADS,
    ):
        registry.add(cls.__name__, cls)


@hookimpl
def pagelm_register_model_loaders(registry) -> None:
    registry.add("auto", SafetensorsLoader)
    registry.add("safetensors", SafetensorsLoader)
    registry.add("dummy", DummyLoader)
