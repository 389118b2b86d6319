"""Comparison helpers that name what differs."""

from __future__ import annotations

import torch


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5):
    """Fail with the name, shapes and the largest difference when tensors differ."""
    if actual is None or expected is None:
        raise AssertionError(f"{name}: one side is None (actual={actual is None}, expected={expected is None})")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if not torch.allclose(actual.float(), expected.float(), atol=atol, rtol=rtol):
        diff = (actual.float() - expected.float()).abs().max().item()
        raise AssertionError(f"{name}: max abs difference {diff:.3e} exceeds atol={atol}, rtol={rtol}")
