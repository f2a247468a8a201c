"""Which documents form the validation split: a seeded sample, fixed by the seed and the document count."""

from __future__ import annotations

import numpy as np


class SplitError(ValueError):
    """The validation fraction leaves one of the splits empty."""


def validation_documents(total: int, fraction: float, seed: int) -> frozenset[int]:
    """A seeded sample of `round(total * fraction)` document numbers (at least one when `fraction > 0`).

    Whole documents go to one split or the other, so no text of a validation document is ever trained on.
    """
    if fraction <= 0.0:
        return frozenset()
    count = max(1, round(total * fraction))
    if count >= total:
        raise SplitError(
            f"data_prep.validation_fraction = {fraction} of {total} documents leaves no training document; "
            "lower the fraction or add documents (whole documents are split, not text inside them)"
        )
    rng = np.random.default_rng(seed)
    return frozenset(int(number) for number in rng.choice(total, size=count, replace=False))
