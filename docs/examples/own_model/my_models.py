"""A model and a dataset of your own, trained by ddpexp without changing it (docs/own-model.md)."""

import torch
from torch import nn
from torch.utils.data import Dataset


class Net(nn.Module):
    """Any nn.Module. ddpexp passes num_classes and input_shape, because __init__ asks for them."""

    def __init__(self, num_classes: int, input_shape: list[int], width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(input_shape[0], width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class Stripes(Dataset):
    """Noisy images of horizontal or vertical stripes: (1 x size x size image, label) samples."""

    classes = ("horizontal", "vertical")  # ddpexp reads the number of classes from here

    def __init__(self, count: int, image_size: int) -> None:
        self.count, self.image_size = count, image_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % 2
        g = torch.Generator().manual_seed(index)
        stripes = (torch.arange(self.image_size) // 2 % 2).float().expand(self.image_size, -1)
        image = stripes.T if label == 0 else stripes
        return (image + 0.5 * torch.randn(image.shape, generator=g)).unsqueeze(0), label


def dataset(count: int = 512, image_size: int = 16) -> Dataset:
    """One Dataset: ddpexp holds out data.val_fraction of it (default 0.1) for evaluation."""
    return Stripes(count, image_size)
