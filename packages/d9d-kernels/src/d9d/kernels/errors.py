"""Errors of backend selection."""

from __future__ import annotations


class BackendUnavailable(RuntimeError):
    """A chosen kernel backend cannot run here (its optional package is missing, or the device lacks support)."""
