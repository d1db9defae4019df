"""ResNet-18/34: torchvision's own (randomly initialised), for any number of classes and input channels.

`cifar_stem=true` replaces the ImageNet stem (7x7 stride-2 conv + max-pool, made for 224x224) by a 3x3
stride-1 conv without pooling, the usual choice for 32x32 images such as CIFAR-10. Stages for model
parallelism: stem, the four residual layers, head.

The model is a torchvision ResNet, so its tensors carry torchvision's names: a state_dict saved from
`torchvision.models.resnet18()` (or its ImageNet weights) loads as it is, with `model.weights=FILE`
(`model.weights_strict=false` for another number of classes: everything but `fc` loads).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn
from torchvision.models.resnet import BasicBlock
from torchvision.models.resnet import ResNet as TorchvisionResNet


class ResNet(TorchvisionResNet):
    # Checkpoints of earlier ddpexp versions named the stem and head by their stage (weights.py reads
    # them through these aliases).
    state_dict_aliases: ClassVar[dict[str, str]] = {"stem.0.": "conv1.", "stem.1.": "bn1.", "head.2.": "fc."}

    def stages(self) -> list[nn.Module]:
        return [
            nn.Sequential(self.conv1, self.bn1, self.relu, self.maxpool),
            self.layer1,
            self.layer2,
            self.layer3,
            self.layer4,
            nn.Sequential(self.avgpool, nn.Flatten(), self.fc),
        ]


def _resnet(depth: int, num_classes: int, input_shape: list[int], cifar_stem: bool) -> ResNet:
    net = ResNet(BasicBlock, [2, 2, 2, 2] if depth == 18 else [3, 4, 6, 3], num_classes=num_classes)
    in_ch = input_shape[0]
    if cifar_stem:
        net.conv1 = nn.Conv2d(in_ch, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_ch != 3:
        net.conv1 = nn.Conv2d(in_ch, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return net


def resnet18(*, num_classes: int, input_shape: list[int], cifar_stem: bool = False) -> ResNet:
    return _resnet(18, num_classes, input_shape, cifar_stem)


def resnet34(*, num_classes: int, input_shape: list[int], cifar_stem: bool = False) -> ResNet:
    return _resnet(34, num_classes, input_shape, cifar_stem)
