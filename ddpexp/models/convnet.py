"""The tutorials' MNIST ConvNet: two conv(5x5)-BatchNorm-ReLU-maxpool blocks and a linear head."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    def __init__(
        self, *, num_classes: int, input_shape: list[int], channels: list[int], batch_norm: bool
    ) -> None:
        super().__init__()
        in_ch, height, width = input_shape
        c1, c2 = channels
        self.layer1 = _block(in_ch, c1, batch_norm)
        self.layer2 = _block(c1, c2, batch_norm)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c2 * (height // 4) * (width // 4), num_classes))

    def stages(self) -> list[nn.Module]:
        return [self.layer1, self.layer2, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(x)))


def _block(cin: int, cout: int, batch_norm: bool) -> nn.Sequential:
    norm: nn.Module = nn.BatchNorm2d(cout) if batch_norm else nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 5, padding=2), norm, nn.ReLU(), nn.MaxPool2d(2))


def convnet(
    *, num_classes: int, input_shape: list[int], channels: list[int] | None = None, batch_norm: bool = True
) -> ConvNet:
    if len(input_shape) != 3:
        raise ValueError(f"convnet needs image input (C, H, W), got shape {input_shape}")
    return ConvNet(
        num_classes=num_classes, input_shape=input_shape, channels=channels or [16, 32], batch_norm=batch_norm
    )
