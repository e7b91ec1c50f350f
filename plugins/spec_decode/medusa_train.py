"""Train Medusa heads for a target model by self-distillation (``pagelm train-eagle --method
medusa``), on the same text the EAGLE trainer makes (``eagle_train.self_distillation_text``)::

    1. prompts --pagelm LLM--> target continuations (no dataset, no hub)
    2. target forward over prompt + continuation -> hidden states f_p (after the final norm)
    3. head i (0-based) at position p, trained towards the target's own prediction at
       p + i + 1, i.e. the token at p + i + 2 (what greedy serving verifies the draft against):
         cross-entropy(lm_head_i(head_i(f_p)), target's argmax at p + i + 1)  weighted decay**i
    4. out_dir/config.json (medusa_num_heads, medusa_num_layers) + model.safetensors

The heads start as Medusa's initialisation: residual blocks at zero (each head is the
identity) and each head's LM head a copy of the target's, so head ``i`` first drafts the
target's next token. Held-out chain accuracy picks the checkpoint that is kept: how many
leading drafts a step would accept on text the heads never saw (``medusa_training.json``).
Training runs on the CPU in float32; the target is frozen.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagelm.plugins.spec_decode.eagle_train import DraftTrainConfig, self_distillation_text
from pagelm.plugins.spec_decode.medusa import MedusaHeads


@dataclass
class MedusaTrainConfig(DraftTrainConfig):
    num_heads: int = 4
    num_layers: int = 1
    # Each head gets its own LM head (Medusa-1's layout, a copy of the target's to start
    # with); False: the heads are saved without and serving uses the target's.
    own_lm_head: bool = True
    # Head i's loss weight is decay**i (Medusa's 0.8): the first drafts matter most, a later
    # one is only accepted after all those before it.
    decay: float = 0.8


def train_medusa_heads(target: str | Path, out_dir: str | Path, cfg: MedusaTrainConfig | None = None, log=print) -> dict:
    """Train and save Medusa heads for ``target``; returns the training report (also written
    to ``out_dir/medusa_training.json``)."""
    from transformers import AutoModelForCausalLM

    cfg = cfg or MedusaTrainConfig()
    target, out_dir = Path(target).expanduser(), Path(out_dir).expanduser()
    torch.manual_seed(cfg.seed)
    start = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    lm_head = model.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    heads = MedusaHeads(hidden, cfg.num_heads, cfg.num_layers, vocab if cfg.own_lm_head else None)
    if heads.lm_head is not None:
        with torch.no_grad():
            heads.lm_head.copy_(lm_head.weight.expand(cfg.num_heads, vocab, hidden))
    config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers, "hidden_size": hidden,
              "vocab_size": vocab, "base_model_name_or_path": str(target)}
    if cfg.steps == 0:  # the initialised heads only (tests; a baseline to compare training with)
        report = {"target": str(target), "steps": 0, "config": cfg.public()}
        _save(heads, config, out_dir, report)
        return report

    sequences = self_distillation_text(target, cfg)
    log(f"train-medusa: {len(sequences)} sequences of {sequences.shape[1]} tokens from the target "
        f"({time.monotonic() - start:.1f} s)")
    with torch.no_grad():
        features = model.get_decoder()(input_ids=sequences).last_hidden_state
    num_val = max(1, len(sequences) // 8)
    val, train_f = features[:num_val], features[num_val:]
    head_logits = _head_logits(heads, lm_head)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    hard = cfg.hard_labels if cfg.hard_labels is not None else cfg.temperature == 0.0
    initial = best = _evaluate(heads, head_logits, val, lm_head)
    best_state = copy.deepcopy(heads.state_dict())
    losses: list[float] = []
    step = 0
    for step in range(1, cfg.steps + 1):
        batch = torch.randint(0, len(train_f), (min(cfg.batch_size, len(train_f)),), generator=gen)
        f = train_f[batch]
        with torch.no_grad():
            teacher = lm_head(f[:, 1:])  # [B, T-1, V]: the target's prediction at p + 1
        states = heads(f[:, :-1])  # [B, T-1, heads, hidden]
        T = states.shape[1]
        loss = states.new_zeros(())
        for i in range(cfg.num_heads):  # head i at p: the target's prediction at p + i + 1
            logits = head_logits(states[:, : T - i, i], i).flatten(0, 1)
            want = teacher[:, i:].flatten(0, 1)
            if hard:
                loss_i = F.cross_entropy(logits, want.argmax(-1))
            else:
                loss_i = -(want.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
            loss = loss + cfg.decay**i * loss_i
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.step()
        losses.append(loss.item())
        out_of_time = cfg.max_seconds is not None and time.monotonic() - start > cfg.max_seconds
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            score = _evaluate(heads, head_logits, val, lm_head)
            if score["accepted_per_step"] > best["accepted_per_step"]:
                best, best_state = score, copy.deepcopy(heads.state_dict())
            recent = losses[-cfg.eval_every :]
            log(f"train-medusa: step {step}/{cfg.steps} loss {sum(recent) / len(recent):.3f} held-out "
                f"drafts accepted per step {score['accepted_per_step']:.2f} (best {best['accepted_per_step']:.2f}), "
                f"per head {', '.join(f'{a:.0%}' for a in score['agreement'])}")
        if out_of_time:
            break
    heads.load_state_dict(best_state)
    report = {
        "target": str(target),
        "steps": step,
        "seconds": round(time.monotonic() - start, 1),
        "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
        # Held out: each head's top-1 agreement with the target, and the drafts a greedy
        # verification would accept per step (leading heads all right), at the start and kept.
        "initial": initial,
        "kept": best,
        "config": cfg.public(),
    }
    _save(heads, config, out_dir, report)
    log(f"train-medusa: wrote {out_dir} (held-out drafts accepted per step with {cfg.num_heads} heads: "
        f"{initial['accepted_per_step']:.2f} at the start, {best['accepted_per_step']:.2f} kept)")
    return report


def _head_logits(heads: MedusaHeads, lm_head):
    """``(states [..., hidden], i) -> logits`` of head ``i``: its own LM head, or the target's."""
    if heads.lm_head is None:
        return lambda states, i: lm_head(states)
    return lambda states, i: states @ heads.lm_head[i].T


@torch.no_grad()
def _evaluate(heads: MedusaHeads, head_logits, features: torch.Tensor, lm_head) -> dict:
    """Each head's agreement with the target's argmax at p + i + 1 over the held-out
    positions, and the mean run of leading heads that agree (greedy drafts accepted per
    step) where every head has a label."""
    target = lm_head(features[:, 1:]).argmax(-1)  # [B, T-1]
    states = heads(features[:, :-1])
    T, H = states.shape[1], heads.num_heads
    right = [(head_logits(states[:, : T - i, i], i).argmax(-1) == target[:, i:]) for i in range(H)]
    chain = torch.stack([r[:, : T - H + 1] for r in right], dim=-1).int().cumprod(-1).sum(-1)
    return {
        "agreement": [round(r.float().mean().item(), 4) for r in right],
        "accepted_per_step": round(chain.float().mean().item(), 4),
    }


def _save(heads: MedusaHeads, config: dict, out_dir: Path, report: dict) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(heads.checkpoint_weights(), str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "medusa_training.json").write_text(json.dumps(report, indent=2))
