"""ResNet-18 and ResNet-50 in plain torch (He et al., 2015), so the recipes need no torchvision.

The layout and parameter names follow ``torchvision.models.resnet18/resnet50`` (stem ``conv1``,
``bn1``; stages ``layer1``..``layer4`` of ``BasicBlock``/``Bottleneck`` blocks with a
``downsample`` branch; head ``fc``), so a state dict saved from one loads into the other. A
torchvision wheel built for another torch (common: a CUDA torchvision beside a CPU torch) fails
at import; building these here keeps ``--model resnet18|resnet50`` working wherever torch does.
"""

from __future__ import annotations

import torch
from torch import nn

# name -> (block kind, blocks per stage)
DEPTHS = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet50": ("bottleneck", (3, 4, 6, 3))}


def _conv3x3(inp: int, out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inp, out, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(inp: int, out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inp, out, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inp: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv3x3(inp, width, stride), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, width), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, inp, H, W]`` to ``[N, width, H/stride, W/stride]``: ``relu(convs(x) + shortcut(x))``."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in torchvision's "ResNet v1.5"), 1x1 expand x4 (ResNet-50)."""

    expansion = 4

    def __init__(self, inp: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv1x1(inp, width), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, width, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = _conv1x1(width, width * 4), nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, inp, H, W]`` to ``[N, 4*width, H/stride, W/stride]``: ``relu(convs(x) + shortcut(x))``."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """A ResNet with the ImageNet stem (7x7/2 conv, 3x3/2 max-pool), for any input channels."""

    def __init__(self, name: str, num_classes: int, in_channels: int = 3) -> None:
        super().__init__()
        kind, blocks = DEPTHS[name]
        block = BasicBlock if kind == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self._inp = 64
        self.layer1 = self._stage(block, 64, blocks[0], stride=1)
        self.layer2 = self._stage(block, 128, blocks[1], stride=2)
        self.layer3 = self._stage(block, 256, blocks[2], stride=2)
        self.layer4 = self._stage(block, 512, blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def _stage(self, block: type[nn.Module], width: int, count: int, stride: int) -> nn.Sequential:
        out = width * block.expansion
        downsample = None
        if stride != 1 or self._inp != out:
            downsample = nn.Sequential(_conv1x1(self._inp, out, stride), nn.BatchNorm2d(out))
        layers = [block(self._inp, width, stride, downsample)]
        layers += [block(out, width, 1, None) for _ in range(count - 1)]
        self._inp = out
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map a batch ``[N, C, H, W]`` to logits ``[N, num_classes]``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
