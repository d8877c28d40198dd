"""Dataset factories as a team would write them, staged by ``--source python:teamnet.data:<name>``."""

from __future__ import annotations

import numpy as np

from traincore.data.digits import read_digits


class Digits:
    """scikit-learn's bundled 8x8 digits as uint8 HxW arrays; ``parity`` relabels them even / odd."""

    def __init__(self, parity: bool = False):
        bunch = read_digits()
        self.images = np.round(bunch.images * (255 / 16)).astype(np.uint8)
        self.labels = bunch.target % 2 if parity else bunch.target
        self.classes = ["even", "odd"] if parity else [str(d) for d in range(10)]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], int(self.labels[index])


def digits() -> Digits:
    """Ten classes: the digit."""
    return Digits()


def parity() -> Digits:
    """Two classes, even and odd: a new task for a model pretrained on ``digits``."""
    return Digits(parity=True)
