"""Models for peers that are processes of their own, and their deterministic "training": torch
only. A process that builds :func:`tests.conftest.tiny_gpt2` imports transformers first (~2.5 s
of CPU, and a longer interpreter teardown at exit); where any model proves the property (a
SIGKILLed peer, a killed rank), these start and end seconds sooner.
"""

from __future__ import annotations

import torch


class Bigram(torch.nn.Module):
    """Next-token logits from the current token alone (66 kB of float32), called as GPT-2 is:
    ``model(input_ids=ids, labels=ids)["loss"]``."""

    def __init__(self, vocab: int = 256, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def tiny_bigram(seed: int = 0) -> Bigram:
    torch.manual_seed(seed)
    return Bigram()


def perturb(model: torch.nn.Module, seed: int, round_: int, scale: float = 0.01) -> None:
    """A peer's "training" for one round: deterministic in (seed, round) and the start weights."""
    gen = torch.Generator().manual_seed(seed * 1000 + round_)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
