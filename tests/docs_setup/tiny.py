# What a page's fragment takes for granted, made small: a BatchNorm ConvNet on 8x8 images and
# random data. tests/test_docs.py runs it before each block marked <!-- runs-after: ... -->.
import glob
import io
import json
import os
import tarfile

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import IterableDataset, TensorDataset

import ddpkit

torch.manual_seed(0)


class MyNet(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)
        )


train_set = TensorDataset(torch.randn(96, 1, 8, 8), torch.randint(0, 10, (96,)))
test_set = big_set = TensorDataset(torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,)))
resume = False
