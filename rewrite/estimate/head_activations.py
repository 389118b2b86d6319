"""What the last stage keeps for its backward beyond its decoder layers: the final norm, the LM head's input and
the loss (`end_bytes`), and what the plain loss holds at its peak beside them (`loss_peak_bytes`); the sizes
and symbols are `layer_activations`'."""

from __future__ import annotations

from .layer_activations import F32, Sizes, norm_bytes

__all__ = ["end_bytes", "loss_peak_bytes"]


def end_bytes(z: Sizes, *, has_head: bool = True, loss_parallel: bool = False) -> int:
    """The last stage's final norm, LM head input and loss, for one microbatch.

    Example:
        >>> z = Sizes(hidden=64, heads=8, kv_heads=4, head_dim=8, intermediate=128, vocab=256, seq_len=16)
        >>> end_bytes(z), end_bytes(dataclasses.replace(z, tp=2), loss_parallel=True)
        (28736, 20608)
    """
    out = norm_bytes(z, z.chunk) + z.tokens * z.dtype_bytes * z.hidden  # the head's input, or the model's output
    if not has_head:
        return out
    if loss_parallel:
        return out + z.tokens * (z.dtype_bytes * z.vocab // z.tp + F32)
    return out + F32 * z.tokens * z.vocab


def loss_peak_bytes(z: Sizes, *, has_head: bool = True, loss_parallel: bool = False) -> int:
    """What the plain loss holds at its peak beyond what `end_bytes` counts: in its backward, beside the
    float32 log-probabilities it kept, the gradient reaching them and the one it hands to the logits,
    float32 [T, V] each: 8 T V (its forward's peak, the logits, their float32 copy and the log-probabilities,
    is lower). Torch's caching allocator reuses them, but the peak has them all. 0 without a head, and
    with loss_parallel (the vocabulary-parallel loss's buffers are not counted).

    Example:
        >>> z = Sizes(hidden=64, heads=8, kv_heads=4, head_dim=8, intermediate=128, vocab=256, seq_len=16)
        >>> loss_peak_bytes(z)
        131072
    """
    return 0 if not has_head or loss_parallel else 2 * F32 * z.tokens * z.vocab
