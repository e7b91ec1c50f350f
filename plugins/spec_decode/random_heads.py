"""Draft heads of a target's shapes with random weights, to measure what speculation costs
(``pagelm bench latency --random-draft-head``): on a random-weight target (a benchmark preset)
a trained head is impossible and unnecessary, since with ``"adaptive": false`` every step
drafts ``k`` tokens and verifies them whatever they are, so a speculative step costs what it
would with a real head that nobody's drafts are accepted from::

    spec-step cost (in plain steps) = plain tokens/s / speculative tokens/s     (batch 1, ~0 accepted)

An EAGLE head is the target's config cut to one decoder layer (what ``pagelm train-eagle``
writes, the same architecture and sizes); Medusa's heads are ``k`` residual blocks that use
the target's LM head (``--medusa-shared-lm-head``'s layout). Weights are drawn from
N(0, 0.02) (norms 1), in the target's dtype, and written once per target and seed. An EAGLE
head may carry a draft vocabulary of the first ``draft_vocab_size`` ids (what a trained
head's most frequent tokens would cost: ``pagelm.plugins.spec_decode.draft_vocab``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagelm.models.loader import default_dtype
from pagelm.plugin_manager import get_plugin_manager

METHODS = ("eagle", "medusa")


def random_draft_head(
    target: str | Path, method: str, out_dir: str | Path, num_heads: int = 4, seed: int = 0,
    draft_vocab_size: int | None = None,
) -> Path:
    """Write (unless already there) a random ``method`` head for ``target`` into ``out_dir``
    (EAGLE: with a draft vocabulary of ids ``0..draft_vocab_size - 1`` unless None)."""
    from transformers import AutoConfig

    assert method in METHODS, f"random draft heads exist for {METHODS}, not {method!r}"
    assert draft_vocab_size is None or method == "eagle", "a draft vocabulary is an EAGLE head's"
    out_dir = Path(out_dir).expanduser()
    stamp = {"random_draft_head": method, "target": str(Path(target).expanduser()), "seed": seed, "num_heads": num_heads,
             "draft_vocab_size": draft_vocab_size}
    done = out_dir / "random_head.json"
    if done.is_file() and json.loads(done.read_text()) == stamp:
        return out_dir
    config = AutoConfig.from_pretrained(Path(target).expanduser())
    text = config.get_text_config()
    dtype = getattr(text, "torch_dtype", None) or getattr(text, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    gen = torch.Generator().manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    if method == "eagle":
        _eagle(config, dtype, gen, out_dir, draft_vocab_size)
    else:
        _medusa(text.hidden_size, num_heads, dtype, gen, out_dir)
    done.write_text(json.dumps(stamp))
    return out_dir


@torch.no_grad()
def _fill(tensors: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(t.shape, dtype=t.dtype)
        elif name.endswith("bias"):
            out[name] = torch.zeros(t.shape, dtype=t.dtype)
        else:
            out[name] = (torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype)
    return out


def _eagle(config, dtype: torch.dtype, gen: torch.Generator, out_dir: Path, draft_vocab_size: int | None) -> None:
    from safetensors.torch import save_file

    from pagelm.plugins.spec_decode.draft_vocab import DRAFT_VOCAB_TENSOR
    from pagelm.plugins.spec_decode.eagle_train import _one_layer

    config = _one_layer(config)
    config.eagle_input_layernorm = True  # the layout train-eagle writes
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    head_cls = get_plugin_manager().collect("model architecture").get(f"Eagle{arch}")
    with default_dtype(dtype):
        head = head_cls(config)
    tensors = _fill(head.checkpoint_weights(), gen)
    data = config.to_dict()
    if draft_vocab_size is not None:
        vocab_size = config.get_text_config().vocab_size
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{vocab_size}, got {draft_vocab_size}")
        tensors[DRAFT_VOCAB_TENSOR] = torch.arange(draft_vocab_size)
        data["draft_vocab_size"] = draft_vocab_size
    save_file(tensors, str(out_dir / "model.safetensors"))
    data.pop("eagle_input_layernorm", None)  # the loader reads it off the weights
    data.update(architectures=[arch], num_hidden_layers=1)
    (out_dir / "config.json").write_text(json.dumps(data, indent=2, default=str))


def _medusa(hidden: int, num_heads: int, dtype: torch.dtype, gen: torch.Generator, out_dir: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for i in range(num_heads):
        tensors[f"{i}.0.linear.weight"] = torch.empty(hidden, hidden, dtype=dtype)
        tensors[f"{i}.0.linear.bias"] = torch.empty(hidden, dtype=dtype)
    save_file(_fill(tensors, gen), str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": 1}))
