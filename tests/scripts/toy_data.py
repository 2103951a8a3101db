"""The data set of the scripts that kill, signal and resume themselves (imported from their folder)."""

import torch

import ddpkit


class NoisyToy(torch.utils.data.Dataset):
    """Fixed random samples with per-sample augmentation noise."""

    def __init__(self, length: int = 60):
        generator = torch.Generator().manual_seed(123)
        self.images = torch.randn(length, 64, generator=generator)
        self.labels = torch.randint(0, 10, (length,), generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        noise = 0.1 * torch.randn(64, generator=ddpkit.sample_rng())
        return self.images[index] + noise, self.labels[index]
