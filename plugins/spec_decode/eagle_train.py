"""Train an EAGLE head for a target model by self-distillation (``pagelm train-eagle``).

No dataset and no hub: the target writes the training text itself, so the head learns to
predict what this target would say::

    1. prompts (stdlib source snippets, or your own) --pagelm LLM--> target continuations
    2. target forward over prompt + continuation -> hidden states f_p (after the final norm)
    3. head(token p+1, f_p) -> g_p, trained towards the target's next step:
         cross-entropy against softmax(lm_head(f_{p+1}))   (the token at p+2)
       + reg_weight * smooth-L1(g_p, f_{p+1})               (EAGLE's feature regression)
    4. out_dir/config.json + model.safetensors in the standard EAGLE layout

With ``draft_vocab_size`` N the head drafts over a draft vocabulary (``draft_vocab``): the N
tokens most frequent in the text of step 1 (ties: the lower id), saved with the head; the
cross-entropy then compares the two distributions over those N tokens only, as drafting
will see them, and the agreement counts a target token outside them as a miss.

The head starts as a copy of the target's first decoder layer reading only the embedding
(``fc = [I | 0]``), i.e. the target truncated to one layer: a working drafter before the first
step, which training then teaches to use the target's hidden state. Training runs on the
CPU in float32 (pagelm's fused GPU ops have no backward).
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagelm.attention import Attention
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.spec_decode.draft_vocab import DRAFT_VOCAB_TENSOR


@dataclass
class DraftTrainConfig:
    """What training any draft head (EAGLE's, Medusa's) on the target's own text takes."""

    num_prompts: int = 128
    prompt_len: int = 16
    gen_len: int = 64
    # Sampling temperature of the target's own text (0: greedy, what greedy serving sees).
    temperature: float = 0.0
    steps: int = 300
    # Stop earlier than ``steps`` once this much wall time is spent (None: no limit).
    max_seconds: float | None = None
    batch_size: int = 16
    # Held-out agreement is measured every this many steps; the best state is kept.
    eval_every: int = 25
    lr: float = 1e-3
    # Cross-entropy against the target's argmax (True) or its whole distribution (False);
    # None: argmax when the text is greedy (temperature 0).
    hard_labels: bool | None = None
    seed: int = 0
    # Text prompts; None: snippets of Python's standard library.
    prompts: list[str] | None = field(default=None, repr=False)

    def lr_at(self, step: int) -> float:
        """The learning rate at ``step``: a linear warm-up over the first tenth, then cosine decay."""
        return self.lr * min(1.0, step / max(1, self.steps // 10)) * 0.5 * (1 + math.cos(math.pi * step / self.steps))

    def public(self) -> dict:
        """The settings as the training report records them (the prompts left out)."""
        return {k: v for k, v in asdict(self).items() if k != "prompts"}


@dataclass
class EagleTrainConfig(DraftTrainConfig):
    reg_weight: float = 0.1
    # EAGLE's uniform noise on the input features, relative to their std: drafting feeds the
    # head its own (imperfect) outputs, so it must not rely on exact ones.
    feature_noise: float = 0.1
    # Draft over the N most frequent tokens of the training text only (None: the whole
    # vocabulary); see ``pagelm.plugins.spec_decode.draft_vocab``.
    draft_vocab_size: int | None = None


def train_eagle_head(target: str | Path, out_dir: str | Path, cfg: EagleTrainConfig | None = None, log=print) -> dict:
    """Train and save a head for ``target``; returns the training report (also written to
    ``out_dir/eagle_training.json``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = cfg or EagleTrainConfig()
    target, out_dir = Path(target).expanduser(), Path(out_dir).expanduser()
    torch.manual_seed(cfg.seed)
    start = time.monotonic()

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    config = _one_layer(AutoConfig.from_pretrained(target))
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    # Keep layer 0's input norm (a variant of the layout the loader recognises by its weight):
    # the head then starts as exactly the target's first layer.
    config.eagle_input_layernorm = True
    head = get_plugin_manager().collect("model architecture").get(f"Eagle{arch}")(config)
    _init_from_target(head, model)
    lm_head = model.get_output_embeddings()
    vocab_size = lm_head.weight.shape[0]
    if cfg.draft_vocab_size is not None and not 1 <= cfg.draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size} (the target's vocabulary), got {cfg.draft_vocab_size}")
    if cfg.steps == 0 and cfg.draft_vocab_size is None:  # the initialised head only (tests; a baseline)
        report = {"target": str(target), "steps": 0, "config": cfg.public()}
        _save(head, config, arch, out_dir, report)
        return report
    head.share_embedding(model.get_input_embeddings())
    shape = _use_causal_attention(head)

    sequences = self_distillation_text(target, cfg)
    log(f"train-eagle: {len(sequences)} sequences of {sequences.shape[1]} tokens from the target "
        f"({time.monotonic() - start:.1f} s)")
    draft_vocab, vocab_report = None, {}
    if cfg.draft_vocab_size is not None:
        draft_vocab, coverage = most_frequent_tokens(sequences, cfg.draft_vocab_size, vocab_size)
        vocab_report = {"draft_vocab_size": len(draft_vocab), "draft_vocab_coverage": round(coverage, 4)}
        log(f"train-eagle: draft vocabulary of {len(draft_vocab)} tokens, {coverage:.1%} of the text's tokens")
    if cfg.steps == 0:  # the initialised head and its draft vocabulary
        report = {"target": str(target), "steps": 0, **vocab_report, "config": cfg.public()}
        _save(head, config, arch, out_dir, report, draft_vocab)
        return report
    with torch.no_grad():
        features = model.get_decoder()(input_ids=sequences).last_hidden_state
    draft_logits = _draft_logits(lm_head, draft_vocab)

    # Held-out sequences pick the checkpoint: the head starts as a working drafter, and
    # training keeps a state only if it predicts the target better on text it never saw.
    num_val = max(1, len(sequences) // 8)
    val = (features[:num_val], sequences[:num_val])
    train_f, train_seq = features[num_val:], sequences[num_val:]
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens.")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    feature_scale = features.std().item()
    gen = torch.Generator().manual_seed(cfg.seed)
    hard = cfg.hard_labels if cfg.hard_labels is not None else cfg.temperature == 0.0
    initial = best = _accuracy(head, shape, *val, lm_head, draft_vocab)
    best_state = copy.deepcopy(head.state_dict())
    losses: list[float] = []
    step = 0
    for step in range(1, cfg.steps + 1):
        batch = torch.randint(0, len(train_seq), (min(cfg.batch_size, len(train_seq)),), generator=gen)
        f, tokens = train_f[batch], train_seq[batch]
        f_in = f[:, :-1]
        if cfg.feature_noise:
            f_in = f_in + (torch.rand(f_in.shape, generator=gen) - 0.5) * 2 * cfg.feature_noise * feature_scale
        g = _run(head, shape, tokens, f_in)
        with torch.no_grad():
            teacher = draft_logits(f[:, 1:])
        logits = draft_logits(g)
        if hard:  # greedy serving accepts the target's argmax: learn exactly that
            loss_cls = F.cross_entropy(logits.flatten(0, 1), teacher.argmax(-1).flatten())
        else:
            loss_cls = -(teacher.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        loss = loss_cls + cfg.reg_weight * F.smooth_l1_loss(g, f[:, 1:])
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.step()
        losses.append(loss.item())
        out_of_time = cfg.max_seconds is not None and time.monotonic() - start > cfg.max_seconds
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            accuracy = _accuracy(head, shape, *val, lm_head, draft_vocab)
            if accuracy > best:
                best, best_state = accuracy, copy.deepcopy(head.state_dict())
            log(f"train-eagle: step {step}/{cfg.steps} loss {sum(losses[-cfg.eval_every:]) / len(losses[-cfg.eval_every:]):.3f} "
                f"held-out agreement {accuracy:.1%} (best {best:.1%})")
        if out_of_time:
            break
    head.load_state_dict(best_state)

    report = {
        "target": str(target),
        "steps": step,
        "seconds": round(time.monotonic() - start, 1),
        "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
        # Top-1 agreement with the target's token one step ahead, on held-out sequences.
        "initial_agreement": round(initial, 4),
        "agreement": round(best, 4),
        **vocab_report,
        "config": cfg.public(),
    }
    _save(head, config, arch, out_dir, report, draft_vocab)
    log(f"train-eagle: wrote {out_dir} (held-out agreement with the target one token ahead: "
        f"{initial:.1%} at the start, {best:.1%} kept)")
    return report


def self_distillation_text(target: Path, cfg: EagleTrainConfig) -> torch.Tensor:
    """[num_prompts, prompt_len + gen_len] token ids: prompts and the target's continuations
    (``cfg``'s text fields: ``num_prompts``, ``prompt_len``, ``gen_len``, ``temperature``,
    ``seed``, ``prompts``; the Medusa trainer shares this)."""
    from pagelm.llm import LLM
    from pagelm.sampling_params import SamplingParams

    llm = LLM(str(target), dtype="float32", device="cpu", seed=cfg.seed,
              max_model_len=cfg.prompt_len + cfg.gen_len + 1)
    prompts = _prompts(llm, cfg)
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.gen_len, ignore_eos=True, seed=cfg.seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.shutdown()
    return torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)])


def _prompts(llm, cfg: EagleTrainConfig) -> list[list[int]]:
    """``num_prompts`` prompts of exactly ``prompt_len`` tokens."""
    rng = random.Random(cfg.seed)
    tokenizer = llm.get_tokenizer()
    texts = cfg.prompts
    if texts is None and tokenizer is not None:
        from pagelm.plugins.demo.model import stdlib_sources

        sources = [text for _, text in stdlib_sources(2_000_000) if len(text) > 4000]
        texts = []
        for _ in range(cfg.num_prompts):
            text = rng.choice(sources)
            offset = rng.randrange(0, len(text) - 2000)
            texts.append(text[offset : offset + 2000])
    out = []
    if texts and tokenizer is not None:
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= cfg.prompt_len:
                out.append(ids[: cfg.prompt_len])
    vocab = llm.engine.vocab_size
    while len(out) < cfg.num_prompts:  # no tokenizer, or prompts too short: random tokens
        out.append([rng.randrange(vocab) for _ in range(cfg.prompt_len)])
    return out[: cfg.num_prompts]


def most_frequent_tokens(sequences: torch.Tensor, n: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``n`` ids most frequent in ``sequences`` (ties: the lower id first), sorted
    ascending, and the share of ``sequences``' tokens they cover."""
    counts = torch.bincount(sequences.flatten(), minlength=vocab_size)
    # A stable sort keeps equal counts in id order.
    top = torch.sort(counts, descending=True, stable=True).indices[:n]
    return top.sort().values, counts[top].sum().item() / max(1, counts.sum().item())


def _draft_logits(lm_head: nn.Module, draft_vocab: torch.Tensor | None):
    """Hidden states -> logits over the draft vocabulary's columns (all of them: ``lm_head``)."""
    if draft_vocab is None:
        return lm_head
    weight = lm_head.weight[draft_vocab]
    bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias[draft_vocab]
    return lambda x: F.linear(x, weight, bias)


def _one_layer(config):
    """The target's config with one decoder layer (per-layer lists, e.g. Qwen's
    ``layer_types``, cut to their first entry)."""
    data = config.to_dict()
    data["num_hidden_layers"] = 1
    for key in ("layer_types",):
        if isinstance(data.get(key), list):
            data[key] = data[key][:1]
    return type(config).from_dict(data)


@torch.no_grad()
def _init_from_target(head: nn.Module, model: nn.Module) -> None:
    """fc = [I | 0] (read the embedding only), the decoder layer = the target's first."""
    hidden = head.fc.weight.shape[0]
    head.fc.weight.zero_()
    head.fc.weight[:, :hidden] = torch.eye(hidden)
    if head.fc.bias is not None:
        head.fc.bias.zero_()
    prefix = "model.layers.0."
    weights = [
        ("layers.0." + name.removeprefix(prefix), t)
        for name, t in model.state_dict().items()
        if name.startswith(prefix)
    ]
    head.load_weights(weights)


class _CausalSelfAttention(nn.Module):
    """Training stand-in for the paged ``Attention``: plain causal attention over
    ``shape["batch"]`` equal-length sequences laid end to end on the token axis."""

    # The model applies its rotary itself, as for a backend without ``AttentionImpl.fuses_rotary``.
    fuses_rotary = False

    def __init__(self, spec, shape: dict) -> None:
        super().__init__()
        self.spec, self.shape = spec, shape

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, s = self.shape["batch"], self.spec
        q, k, v = (x.view(B, -1, n, s.head_dim).transpose(1, 2) for x, n in ((q, s.num_heads), (k, s.num_kv_heads), (v, s.num_kv_heads)))
        group = s.num_heads // s.num_kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True, scale=s.scale
        )
        return out.transpose(1, 2).reshape(-1, s.num_heads * s.head_dim)


def _use_causal_attention(head: nn.Module) -> dict:
    shape = {"batch": 1}
    for module in list(head.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Attention):
                setattr(module, name, _CausalSelfAttention(child.spec, shape))
    return shape


def _run(head, shape, tokens: torch.Tensor, features_in: torch.Tensor) -> torch.Tensor:
    """The head over [B, T] sequences: position p reads token p+1 and feature p."""
    B, T = features_in.shape[:2]
    shape["batch"] = B
    positions = torch.arange(T).repeat(B)
    return head(tokens[:, 1:].reshape(-1), positions, features_in.reshape(B * T, -1)).view(B, T, -1)


@torch.no_grad()
def _accuracy(head, shape, features, sequences, lm_head, draft_vocab: torch.Tensor | None = None) -> float:
    """How often the head's draft (its argmax, over the draft vocabulary when there is one)
    equals the target's argmax, one step ahead."""
    g = _run(head, shape, sequences, features[:, :-1])
    drafts = _draft_logits(lm_head, draft_vocab)(g).argmax(-1)
    if draft_vocab is not None:
        drafts = draft_vocab[drafts]
    return (drafts == lm_head(features[:, 1:]).argmax(-1)).float().mean().item()


def _save(head: nn.Module, config, arch: str, out_dir: Path, report: dict, draft_vocab: torch.Tensor | None = None) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = head.checkpoint_weights()
    if draft_vocab is not None:
        tensors[DRAFT_VOCAB_TENSOR] = draft_vocab.long().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    data = config.to_dict()
    for key in ("eagle_fc_bias", "eagle_input_layernorm", "eagle_own_embedding"):
        data.pop(key, None)
    data.update(architectures=[arch], num_hidden_layers=1)
    if draft_vocab is not None:
        data["draft_vocab_size"] = len(draft_vocab)
    (out_dir / "config.json").write_text(json.dumps(data, indent=2, default=str))
    (out_dir / "eagle_training.json").write_text(json.dumps(report, indent=2))
