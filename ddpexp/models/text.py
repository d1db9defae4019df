"""Text classifiers over token ids (B, L) with id `pad_index` as padding.

- `gcnn`: the tutorials' gated convolutional network: embedding -> two gated 1-D conv blocks
  (A * sigmoid(B), kernel 3, length-preserving) -> mean over time -> linear -> ReLU -> linear.
- `embbag`: EmbeddingBag (mean of the review's word vectors, padding skipped) -> linear.
"""

from __future__ import annotations

import torch
from torch import nn


class Embed(nn.Module):
    """Token ids (B, L) -> channels-first vectors (B, E, L) for the convolutions."""

    def __init__(self, vocab_size: int, dim: int, pad_index: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=pad_index)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids).transpose(1, 2)


class GatedConv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int) -> None:
        super().__init__()
        self.a = nn.Conv1d(cin, cout, kernel, padding=kernel // 2)
        self.b = nn.Conv1d(cin, cout, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * torch.sigmoid(self.b(x))


class GCNN(nn.Module):
    def __init__(
        self, *, vocab_size: int, pad_index: int, num_classes: int, embed_dim: int, channels: int, hidden: int
    ) -> None:
        super().__init__()
        self.embed = Embed(vocab_size, embed_dim, pad_index)
        self.block1 = GatedConv(embed_dim, channels, 3)
        self.block2 = GatedConv(channels, channels, 3)
        self.head = nn.Sequential(
            _MeanOverTime(), nn.Linear(channels, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def stages(self) -> list[nn.Module]:
        return [self.embed, self.block1, self.block2, self.head]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(self.block1(self.embed(ids))))


class _MeanOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=2)


class EmbBag(nn.Module):
    def __init__(self, *, vocab_size: int, pad_index: int, num_classes: int, embed_dim: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean", padding_idx=pad_index)
        self.fc = nn.Linear(embed_dim, num_classes)

    def stages(self) -> list[nn.Module]:
        return [self.bag, self.fc]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(ids))


def gcnn(
    *,
    vocab_size: int,
    pad_index: int,
    num_classes: int,
    embed_dim: int = 64,
    channels: int = 64,
    hidden: int = 64,
) -> GCNN:
    return GCNN(
        vocab_size=vocab_size,
        pad_index=pad_index,
        num_classes=num_classes,
        embed_dim=embed_dim,
        channels=channels,
        hidden=hidden,
    )


def embbag(*, vocab_size: int, pad_index: int, num_classes: int, embed_dim: int = 64) -> EmbBag:
    return EmbBag(vocab_size=vocab_size, pad_index=pad_index, num_classes=num_classes, embed_dim=embed_dim)
