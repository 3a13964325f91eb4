"""Stage 2: the data. scikit-learn's 8x8 handwritten digits in two domains: the *source* domain is the
upright digits, the *shifted* domain the same digits rotated by 90 degrees."""

from __future__ import annotations

import dataclasses

import torch

from .options import DemoError

__all__ = ["DigitsData", "load_digits_domains", "rotate"]


@dataclasses.dataclass(frozen=True)
class DigitsData:
    """Train/test tensors of both domains: images ``(N, 1, 8, 8)`` float32 in [0, 1], labels ``(N,)``."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    shifted_train_x: torch.Tensor
    shifted_test_x: torch.Tensor

    def to(self, device: torch.device | str) -> DigitsData:
        """The same data on ``device``."""
        return DigitsData(*(t.to(device) for t in dataclasses.astuple(self)))


def rotate(images: torch.Tensor) -> torch.Tensor:
    """The shifted domain: images ``(N, 1, 8, 8)`` rotated 90 degrees counter-clockwise."""
    return torch.rot90(images, 1, dims=(-2, -1)).contiguous()


def load_digits_domains(seed: int, test_fraction: float = 0.25) -> DigitsData:
    """scikit-learn's 1,797 handwritten digits, split (seeded) into train and test, in both domains.

    Raises:
        DemoError: scikit-learn is not installed (``pip install -e '.[demo]'`` from the loragen checkout).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DemoError(
            "the demo needs scikit-learn: pip install -e '.[demo]' (from the loragen checkout)"
        ) from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    train, test = order[n_test:], order[:n_test]
    return DigitsData(
        train_x=images[train],
        train_y=labels[train],
        test_x=images[test],
        test_y=labels[test],
        shifted_train_x=rotate(images[train]),
        shifted_test_x=rotate(images[test]),
    )
