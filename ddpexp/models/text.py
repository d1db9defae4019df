"""Text classifiers over token ids (B, L) with id `pad_index` as padding.

- `gcnn`: tutorial 001's gated convolutional network as it builds it: xavier-initialised embedding ->
  two gated 1-D conv blocks A * sigmoid(B) with kernel 15, stride 7 -> mean over time -> linear(64,
  128) -> linear(128, classes), no activation between the two linears. Trained with task=binary (BCE
  against one-hot targets) as the tutorial does. `kernel_size`/`stride` change the convolutions.
- `embbag`: EmbeddingBag (mean of the review's word vectors, padding skipped) -> linear.
"""

from __future__ import annotations

import torch
from torch import nn


class Embed(nn.Module):
    """Token ids (B, L) -> channels-first vectors (B, E, L) for the convolutions."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim)
        nn.init.xavier_uniform_(self.embedding.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids).transpose(1, 2)


class GatedConv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.a = nn.Conv1d(cin, cout, kernel, stride=stride)
        self.b = nn.Conv1d(cin, cout, kernel, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * torch.sigmoid(self.b(x))


class GCNN(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        num_classes: int,
        embed_dim: int,
        channels: int,
        hidden: int,
        kernel_size: int,
        stride: int,
    ) -> None:
        super().__init__()
        self.embed = Embed(vocab_size, embed_dim)
        self.block1 = GatedConv(embed_dim, channels, kernel_size, stride)
        self.block2 = GatedConv(channels, channels, kernel_size, stride)
        self.head = nn.Sequential(
            _MeanOverTime(), nn.Linear(channels, hidden), nn.Linear(hidden, num_classes)
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
    num_classes: int,
    input_shape: list[int],
    embed_dim: int = 64,
    channels: int = 64,
    hidden: int = 128,
    kernel_size: int = 15,
    stride: int = 7,
) -> GCNN:
    shortest = kernel_size + stride * (kernel_size - 1)  # two unpadded convolutions must fit
    if input_shape[0] < shortest:
        from ..errors import UserError

        raise UserError(
            f"reviews of {input_shape[0]} tokens are too short for two convolutions of kernel "
            f"{kernel_size}, stride {stride} (need {shortest})",
            setting="data.max_len",
            fix=f"set data.max_len={shortest} or more, or model.kernel_size=3 model.stride=1",
        )
    return GCNN(
        vocab_size=vocab_size,
        num_classes=num_classes,
        embed_dim=embed_dim,
        channels=channels,
        hidden=hidden,
        kernel_size=kernel_size,
        stride=stride,
    )


def embbag(*, vocab_size: int, pad_index: int, num_classes: int, embed_dim: int = 64) -> EmbBag:
    return EmbBag(vocab_size=vocab_size, pad_index=pad_index, num_classes=num_classes, embed_dim=embed_dim)
