"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, LongCat-Flash) split over tp: the checks.

An MLA block projects the hidden states down to latents (`q_a_proj`, `kv_a_proj_with_mqa`), normalizes
them (`q_a_layernorm`, `kv_a_layernorm`) and projects them up to the heads (`q_b_proj`, `kv_b_proj`: column
layers), `o_proj` (row) summing the heads back. Split over tp, every rank computes the latents whole, and
their gradients come back whole through the column layers' f, so these modules stay as they are. One
exception: the last `qk_rope_head_dim` outputs of `kv_a_proj_with_mqa` (the rotary key every head shares)
skip `kv_b_proj` and reach the heads directly; each rank's gradient of them covers its own heads only, so
they are summed over tp (style `mla_kv_a`). Without that rule the split trains wrong gradients: refused.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..models.blocks import KV_A
from ..plan.patterns import general_path
from ..plan.styles import COLUMN_STYLES, STYLE_INFO

__all__ = ["STYLE", "is_latent_attention", "latent_problems", "rope_width"]

STYLE = "mla_kv_a"


def is_latent_attention(module: nn.Module) -> bool:
    """Whether `module` is an MLA block: it holds a `kv_a_proj_with_mqa` linear."""
    return isinstance(getattr(module, KV_A, None), nn.Linear)


def rope_width(model: nn.Module, attention: nn.Module) -> int | None:
    """The rotary key's features at the end of the kv_a projection's output: the block's `qk_rope_head_dim`,
    else its config's; None when neither says."""
    width = getattr(attention, "qk_rope_head_dim", None)
    if width is None:
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        width = getattr(text, "qk_rope_head_dim", None)
    return width if isinstance(width, int) and width > 0 else None


def latent_problems(model: nn.Module, modules: dict[str, nn.Module], chosen: dict[str, tuple[str, str]], tp: int,
                    at: Callable[[str], str]) -> list[str]:
    """Every problem with the MLA blocks of a plan splitting over `tp` > 1: `chosen` maps each module the
    rules name to (its rule's pattern, style), `at(pattern)` gives the rule's line prefix."""
    problems = []
    split = {fqn.rpartition(".")[0] for fqn, (_, style) in chosen.items()
             if style in COLUMN_STYLES or STYLE_INFO[style].layer == "row"}
    for fqn, (pattern, style) in chosen.items():
        if style != STYLE:
            continue
        parent = fqn.rpartition(".")[0]
        where = f"{at(pattern)}tensor_parallel[{pattern!r}] matches {fqn!r}"
        width, out = rope_width(model, modules[parent]), getattr(modules[fqn], "out_features", 0)
        if width is None or width >= out:
            problems.append(f"{where}, and neither {type(modules[parent]).__name__} nor the config gives a "
                            f"qk_rope_head_dim below its {out} output features; style '{STYLE}' sums the gradient of "
                            "that many rotary features: use it on multi-head latent attention's kv_a_proj_with_mqa")
        elif parent not in split:
            problems.append(f"{where}, whose attention {parent} is not split over tp (no column or row layer in "
                            f"it): summing the rotary key's gradient would count it tp times; leave {fqn} whole")
    for parent in sorted(split):
        attention = modules.get(parent)
        if attention is None or not is_latent_attention(attention):
            continue
        kv_a = f"{parent}.{KV_A}"
        if chosen.get(kv_a, ("", ""))[1] != STYLE:
            width = rope_width(model, attention)
            problems.append(
                f"{general_path(kv_a)} feeds its last {width or 'qk_rope_head_dim'} features (the rotary key every head "
                f"shares) straight to the heads the plan splits over tp in {general_path(parent)}: each rank's gradient "
                f"of them would be partial; add tensor_parallel['{general_path(kv_a)}']: {STYLE} (Hugging Face: "
                "mla_kv_a_proj), or leave the attention whole")
        heads = getattr(attention, "num_heads", None) or getattr(getattr(model, "config", None),
                                                                 "num_attention_heads", None)
        if isinstance(heads, int) and heads % tp:
            problems.append(f"{general_path(parent)} has {heads} heads, which mesh.tp={tp} does not split whole; use a tp "
                            "dividing the heads, or leave the attention whole")
    return list(dict.fromkeys(problems))
