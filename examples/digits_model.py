"""A small convolutional classifier for scikit-learn's 8x8 handwritten digits.

`loragen demo` pretrains this model on upright digits, then rewrites this file with `loragen rewrite`
(its convolutions and linear layers become LoRA layers) and adapts the model to rotated digits.
Try it yourself:

    loragen rewrite examples/digits_model.py --diff --target-modules conv1,conv2,fc
"""

import torch
from torch import nn


class DigitsNet(nn.Module):
    """Two conv blocks and a two-layer MLP head: (batch, 1, 8, 8) images -> (batch, 10) logits."""

    def __init__(self, width: int = 32, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        # After one 2x2 pooling the 8x8 image is 4x4.
        self.fc = nn.Linear(2 * width * 4 * 4, hidden)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(images))  # (B, width, 8, 8)
        x = self.pool(torch.relu(self.conv2(x)))  # (B, 2 * width, 4, 4)
        x = torch.relu(self.fc(x.flatten(1)))  # (B, hidden)
        return self.head(self.dropout(x))  # (B, num_classes)
