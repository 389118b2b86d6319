"""LoRA's terms in the estimates, in one place: what a layer's adapters keep for the backward
(`layer_activations`) and the FLOPs they compute (`stage_time`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layer_activations import Sizes

__all__ = ["lora_bytes", "lora_flops"]


def lora_bytes(z: Sizes, inputs: tuple[str, ...], output: str, output_in: int) -> int:
    """What a block's LoRA adapters change in what it keeps: each adapter its `[rows, r]` product for B's
    gradient (its input, which A's gradient reads, is the one the block keeps for its weights' gradients in
    full training). With dropout each keeps its dropped copy of the input and the mask instead, and the
    inputs only the frozen layers read are let go. `output_in`: the row layer's input features on a rank.
    Measured against autograd's saved tensors (tests/unit/lora): a LLaMA layer's, exactly as the full layer
    is estimated. A block's frozen layer without an adapter keeps nothing for its weight: an upper bound."""
    rows, B = z.mlp_rows, z.dtype_bytes
    widths = [z.hidden for name in inputs if name in z.lora_leaves] + ([output_in] if output in z.lora_leaves else [])
    kept = len(widths) * rows * z.lora_rank * B
    if not z.lora_dropout:
        return kept
    freed = (z.hidden if any(n in z.lora_leaves for n in inputs) else 0) + (output_in if output in z.lora_leaves else 0)
    return kept + rows * B * (2 * sum(widths) - freed)


def lora_flops(z: Sizes, ta: int, tm: int, kv_share: int) -> float:
    """One forward's FLOPs of a layer's LoRA adapters on a rank: `2 rows r (in + out)` each, a column layer's A
    whole and B its rows, a row layer's A its input features and B whole (`ta`, `tm`: the blocks' tp split)."""
    h, d, r, rows = z.hidden, z.head_dim, z.lora_rank, z.mlp_rows
    q, kv, i = z.heads * d // ta, z.kv_heads * kv_share * d // ta, z.intermediate // tm
    widths = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    if not z.top_k:  # a dense MLP (adapters on routed experts are refused)
        widths.update(gate_proj=h + i, up_proj=h + i, down_proj=i + h, gate_up_proj=h + 2 * i)
    return 2.0 * rows * r * sum(w for name, w in widths.items() if name in z.lora_leaves)
