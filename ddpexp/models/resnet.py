"""ResNet-18/34 from torchvision (randomly initialised), for any number of classes and input channels.

`cifar_stem=true` replaces the ImageNet stem (7x7 stride-2 conv + max-pool, made for 224x224) by a 3x3
stride-1 conv without pooling, the usual choice for 32x32 images such as CIFAR-10. Stages for model
parallelism: stem, the four residual layers, head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ResNet(nn.Module):
    def __init__(self, net: Any) -> None:  # a torchvision ResNet
        super().__init__()
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.head = nn.Sequential(net.avgpool, nn.Flatten(), net.fc)

    def stages(self) -> list[nn.Module]:
        return [self.stem, self.layer1, self.layer2, self.layer3, self.layer4, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages():
            x = stage(x)
        return x


def _resnet(depth: int, num_classes: int, input_shape: list[int], cifar_stem: bool) -> ResNet:
    from torchvision import models

    net = (models.resnet18 if depth == 18 else models.resnet34)(weights=None, num_classes=num_classes)
    in_ch = input_shape[0]
    if cifar_stem:
        net.conv1 = nn.Conv2d(in_ch, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_ch != 3:
        net.conv1 = nn.Conv2d(in_ch, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return ResNet(net)


def resnet18(*, num_classes: int, input_shape: list[int], cifar_stem: bool = False) -> ResNet:
    return _resnet(18, num_classes, input_shape, cifar_stem)


def resnet34(*, num_classes: int, input_shape: list[int], cifar_stem: bool = False) -> ResNet:
    return _resnet(34, num_classes, input_shape, cifar_stem)
