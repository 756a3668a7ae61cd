"""Models for peers that are processes of their own, and their deterministic "training".

Importing this module imports torch only, so that a peer process (``tests/peer_proc.py``,
``tests/group_peer.py``) pays for nothing else: not for pytest, the hub or the harness, which
``tests.conftest`` imports (~0.7 s of CPU a process). :func:`tiny_gpt2` imports transformers when
called (~2.5 s of CPU, and a longer interpreter teardown at exit); where any model proves the
property (a SIGKILLed peer, a killed rank), :class:`Bigram` starts and ends seconds sooner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel


def tiny_gpt2(seed: int = 0, **overrides: int) -> GPT2LMHeadModel:
    """A randomly initialised GPT-2 small enough for a unit test (~40k parameters)."""
    from transformers import GPT2Config, GPT2LMHeadModel  # tests.conftest imports it before any thread does

    torch.manual_seed(seed)
    shape = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 32, **overrides}
    config = GPT2Config(bos_token_id=0, eos_token_id=0, **shape)
    return GPT2LMHeadModel(config)


class Blocks(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random 16-token blocks, different per seed (each peer its own shard), for a Trainer."""

    def __init__(self, n: int, seed: int, vocab: int = 256) -> None:
        self.ids = torch.randint(0, vocab, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


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
