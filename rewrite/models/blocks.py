"""The blocks of a LLaMA-shaped decoder layer that tp splits through the middle, by their projections' names:
input projections split by output features (column), the output projection by input features (row), so
one sum joins the ranks. Read by the tp rules and checks, the tp layers' wiring and the estimates."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Block", "ATTENTION", "LATENT_ATTENTION", "MLP", "PACKED_MLP", "SPLITTERS", "KV_A", "LAYER_PARTS"]


@dataclass(frozen=True)
class Block:
    """One kind of block: its projections, and the child of a decoder layer that holds it."""

    inputs: tuple[str, ...]  # split by output features (column), in the order a message names them
    output: str  # split by input features (row): it reads the inputs' split outputs
    splitter: str  # the input whose split marks the block split: one, so that a block counts once
    layer_part: str  # the decoder layer's child holding it
    kv: tuple[str, ...] = ()  # the key, then the value projection: whole kv heads, replicated when tp passes them
    whole: tuple[str, ...] = ()  # modules run whole before the split inputs (the latents and their norms)

    @property
    def members(self) -> tuple[str, ...]:
        return (*self.inputs, self.output)


KV_A = "kv_a_proj_with_mqa"  # latent attention's kv latent, ending in the rotary key every head shares
ATTENTION = Block(("q_proj", "k_proj", "v_proj"), "o_proj", "q_proj", "self_attn", kv=("k_proj", "v_proj"))
# Multi-head latent attention (DeepSeek): latents computed whole, then projected up to the heads (queries
# without a latent, as in DeepSeek-V2-Lite, come from q_proj).
LATENT_ATTENTION = Block(("q_b_proj", "kv_b_proj"), "o_proj", "q_b_proj", "self_attn",
                         whole=("q_a_proj", "q_a_layernorm", KV_A, "kv_a_layernorm"))
MLP = Block(("gate_proj", "up_proj"), "down_proj", "up_proj", "mlp")  # up_proj: there is one where there is no gate
PACKED_MLP = Block(("gate_up_proj",), "down_proj", "gate_up_proj", "mlp")  # gate and up side by side: packed_column

# The splitter's name -> its block, for the blocks told apart by that name alone.
SPLITTERS = {block.splitter: block for block in (ATTENTION, MLP, PACKED_MLP)}
# The children of a decoder layer, in order (activation checkpointing is estimated per part).
LAYER_PARTS = ("input_layernorm", ATTENTION.layer_part, "post_attention_layernorm", MLP.layer_part)
