"""What the vision-language models here share: a vision tower feeds a language model, which
does every text step. The wrapper's model interface is the language model's."""

from __future__ import annotations

import torch
from torch import nn


class LanguageModelDelegate:
    """The text half of a vision-language model: ``forward``, the embedding table and the
    logits are ``self.language_model``'s (a pagelm causal LM)."""

    language_model: nn.Module

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds=inputs_embeds)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)
