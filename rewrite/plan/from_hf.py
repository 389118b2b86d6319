"""Plans from a Hugging Face model's own tensor-parallel plan (`base_model_tp_plan`)."""

from __future__ import annotations

from torch import nn

from .schema import STYLE_ALIASES, STYLES, ParallelPlan, load_plan

__all__ = ["plan_from_hf"]


def _model_class(config):
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        raise ValueError(f"{type(config).__name__} has no causal-LM model class in transformers") from None


def plan_from_hf(
    model_or_config,
    *,
    tp: int = 1,
    pp: int = 1,
    microbatches: int = 1,
    cut_points: list[str] | str | None = None,
    schedule: str = "afab",
    virtual_stages: int = 1,
) -> ParallelPlan:
    """A plan from the model's `base_model_tp_plan` (and its `lm_head` rule when untied).

    Args:
        model_or_config: a transformers model (a causal LM or its base model) or config.
        tp, pp: the mesh.
        microbatches, cut_points, schedule, virtual_stages: the pipeline
            (cut_points None: balanced; "auto": by estimated compute).

    Returns:
        A `ParallelPlan` whose module paths are relative to the model, e.g.
        `model.layers.*.self_attn.q_proj` for `LlamaForCausalLM`.

    Raises:
        ValueError: the model has no tensor-parallel plan, or uses styles this
            toolkit does not implement (named, with the modules they apply to).

    Example:
        >>> plan = plan_from_hf(LlamaConfig(), tp=2)
        >>> plan.tensor_parallel["model.layers.*.mlp.down_proj"]
        'row'
    """
    if isinstance(model_or_config, nn.Module):
        model, config = model_or_config, model_or_config.config
        prefix = getattr(model, "base_model_prefix", "")
        if not (prefix and isinstance(getattr(model, prefix, None), nn.Module)):
            prefix = ""  # a bare base model: its paths have no prefix
        head_rules = dict(getattr(type(model), "_tp_plan", None) or {}) if prefix else {}
    else:
        config = model_or_config
        cls = _model_class(config)
        prefix, head_rules = cls.base_model_prefix, dict(getattr(cls, "_tp_plan", None) or {})
    base_rules = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base_rules:
        raise ValueError(f"{type(config).__name__} has no base_model_tp_plan to build a plan from")
    rules = {(f"{prefix}.{k}" if prefix else k): v for k, v in base_rules.items()}
    if not getattr(config, "tie_word_embeddings", False):
        rules.update(head_rules)  # a tied LM head stays whole: sharding it would untie it
    known = {*STYLES, *STYLE_ALIASES}
    unsupported = {k: v for k, v in rules.items() if v not in known}
    if unsupported:
        listed = ", ".join(f"{k}: {v}" for k, v in unsupported.items())
        raise ValueError(
            f"{type(config).__name__}'s tensor-parallel plan uses styles this toolkit does not implement ({listed}); "
            f"supported: {', '.join(sorted(known))}"
        )
    pipeline = {"microbatches": microbatches, "schedule": schedule, "virtual_stages": virtual_stages}
    if cut_points is not None:
        pipeline["cut_points"] = cut_points
    # Through load_plan, so a bad argument reads like a bad plan file: each problem with its fix.
    return load_plan({"mesh": {"pp": pp, "tp": tp}, "tensor_parallel": rules, "pipeline": pipeline})
