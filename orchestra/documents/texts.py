"""The texts that ship in ``orchestra/family/data``, by name: the held-out text and the calibration texts.

A module of its own, outside :mod:`orchestra.family`, so that the runtime mapping store reads the
calibration texts without importing the family package, which imports the store to calibrate the
family's mappings at build time (the import contracts forbid that cycle).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DATA_DIR", "HELDOUT_TEXT", "CALIBRATION_TEXTS", "data_text"]

DATA_DIR = Path(__file__).parents[1] / "family" / "data"
HELDOUT_TEXT = "gpl-3.txt"
CALIBRATION_TEXTS = ("mpl-2.0.txt", "apache-2.0.txt", "gfdl-1.3.txt")


def data_text(name: str) -> str:
    """A text shipped in orchestra/family/data."""
    return (DATA_DIR / name).read_text(encoding="utf-8")
