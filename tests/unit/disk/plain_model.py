"""A small model with tied weights and buffers, knowing nothing of DeadPool (plain_load.py builds it too)."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)  # running stats and an int64 0-dim counter: buffers, not stable
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.wte.weight  # tied: one tensor, two names
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.ln(self.wte(idx))))
