"""Plans from a Hugging Face model's own tensor-parallel plan (`base_model_tp_plan`)."""

from __future__ import annotations

import math

from torch import nn

from ..models.expert_split import split_problem, tp_layout
from ..models.hf_decoder import meta_model
from .loading import load_plan
from .patterns import match_pattern
from .schema import ParallelPlan
from .styles import NEEDS_NO_RULE, STYLE_ALIASES, STYLES

__all__ = ["plan_from_hf"]


def _embedding_name(config, base_rules: dict[str, str]) -> str:
    """The base model's token embedding: the part its `base_model_pp_plan` feeds input_ids, else the
    module its tp plan splits by vocabulary, else LLaMA's name."""
    for name, (inputs, _) in (getattr(type(config), "base_model_pp_plan", None) or {}).items():
        if "input_ids" in inputs:
            return name
    return next((k for k, v in base_rules.items() if v == "embedding_rowwise"), "embed_tokens")


def plan_from_hf(
    model_or_config,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dp: int | None = None,
    microbatches: int = 1,
    cut_points: list[str] | str | None = None,
    schedule: str = "afab",
    virtual_stages: int = 1,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
) -> ParallelPlan:
    """A plan from the model's `base_model_tp_plan` (and its `lm_head` rule when untied), and for a
    mixture of experts its `base_model_ep_plan`.

    Hugging Face style names map onto ours (`STYLE_ALIASES`). Tied embeddings are one matrix: without
    loss_parallel the head and the embedding stay whole (a declared `vocab` rule is dropped); with it
    both are split along the vocabulary alike. Fused experts modules get the ep plan's rule
    (`expert_parallel`, checked at ep 1 too) in place of the tp rules inside them; at tp > 1 and ep 1,
    where the tp plan splits each expert (`moe_tp_experts`) and they add up so split,
    `expert_tensor_parallel` instead. Tp rules matching no module of the model are left out.

    Args:
        model_or_config: a transformers model (a causal LM or its base model) or config.
        tp, pp: the mesh.
        ep, dp: experts split over ep ranks borrowed from a stage's dp x tp ranks (dp defaults to the fewest
            replicas that make room for ep: ep / gcd(ep, tp)).
        microbatches, cut_points, schedule, virtual_stages: the pipeline (cut_points None: balanced).
        loss_parallel: the LM head becomes 'column' and the cross-entropy works on vocabulary shards; with
            tied embeddings the embedding becomes 'vocab' too when the model declares no rule for it.
        sequence_parallel: the plan's `sequence_parallel`.

    Returns:
        A `ParallelPlan` whose module paths are relative to the model (`model.layers.*.self_attn.q_proj`).

    Raises:
        ValueError: the model has no tensor-parallel plan, uses styles this toolkit does not implement
            (named, with their modules), or loss_parallel is asked of a model without an LM head.

    Example:
        >>> plan = plan_from_hf(LlamaConfig(), tp=2)
        >>> plan.tensor_parallel["model.layers.*.mlp.down_proj"]
        'row'
        >>> plan_from_hf(LlamaConfig(), tp=2, loss_parallel=True).tensor_parallel["lm_head"]
        'column'
    """
    model, config, prefix, head_rules = _model_and_prefix(model_or_config)
    base_rules = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base_rules:
        raise ValueError(f"{type(config).__name__} has no base_model_tp_plan to build a plan from")
    rules = {(f"{prefix}.{k}" if prefix else k): v for k, v in base_rules.items()}
    rules = _with_experts(rules, config, prefix, model, split_over_tp=tp > 1 and ep == 1)
    rules = _with_head(rules, model_or_config, config, prefix, head_rules, base_rules, loss_parallel)
    rules = {k: v for k, v in rules.items() if v not in NEEDS_NO_RULE}  # local_params: how HF's DTensors run
    _refuse_unsupported(config, rules)
    pipeline = {"microbatches": microbatches, "schedule": schedule, "virtual_stages": virtual_stages}
    if cut_points is not None:
        pipeline["cut_points"] = cut_points
    # Through load_plan, so a bad argument reads like a bad plan file: each problem with its fix.
    return load_plan({
        "mesh": {"pp": pp, "tp": tp, "ep": ep, "dp": _replicas(ep, tp) if dp is None else dp},
        "tensor_parallel": rules,
        "pipeline": pipeline,
        "loss_parallel": loss_parallel,
        "sequence_parallel": sequence_parallel,
    })


def _model_and_prefix(model_or_config) -> tuple[nn.Module | None, object, str, dict]:
    """(the model, or a meta one built from the config, None when its class cannot build it; the config; the
    attribute holding the base model, "" for a bare base model; the causal LM's own head rules)."""
    if isinstance(model_or_config, nn.Module):
        model, config = model_or_config, model_or_config.config
        prefix = _base_attribute(model)
        head_rules = dict(getattr(type(model), "_tp_plan", None) or {}) if prefix else {}
        return model, config, prefix, head_rules
    from transformers import AutoModelForCausalLM

    config, model = model_or_config, None
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{type(config).__name__} has no causal-LM model class in transformers") from None
    prefix, head_rules = cls.base_model_prefix, dict(getattr(cls, "_tp_plan", None) or {})
    try:  # where its base model really sits (Llama 4's is not where its prefix says)
        model = meta_model(config)
        prefix = _base_attribute(model) or prefix
    except Exception:  # noqa: BLE001 - a config its class cannot build: its prefix as declared
        model = None
    return model, config, prefix, head_rules


def _with_head(rules: dict, model_or_config, config, prefix: str, head_rules: dict, base_rules: dict,
               loss_parallel: bool) -> dict:
    """`rules` with the LM head's and, for tied embeddings, the embedding's as `plan_from_hf` says."""
    tied = getattr(config, "tie_word_embeddings", False)
    if loss_parallel:
        if not prefix:
            raise ValueError(f"loss_parallel=True needs a causal LM with an LM head; {type(model_or_config).__name__} "
                             "is a bare base model: pass the ...ForCausalLM (or its config), or leave loss_parallel "
                             "False")
        heads = list(head_rules) or ["lm_head"]
        rules.update({head: "column" for head in heads})  # the logits stay split by vocabulary
        embed = f"{prefix}.{_embedding_name(config, base_rules)}"
        if tied and not any(_is_vocab(v) for v in rules.values()):
            rules[embed] = "vocab"  # one matrix: the embedding keeps the same vocabulary rows as the head
    elif tied:
        # A tied head stays whole, and so does the embedding: sharding one end would untie them.
        rules = {k: v for k, v in rules.items() if not _is_vocab(v)}
    else:
        rules.update(head_rules)
    return rules


def _refuse_unsupported(config, rules: dict) -> None:
    """ValueError naming the rules whose styles this toolkit does not implement."""
    known = {*STYLES, *STYLE_ALIASES}
    unsupported = {k: v for k, v in rules.items() if v not in known}
    if unsupported:
        listed = ", ".join(f"{k}: {v}" for k, v in unsupported.items())
        raise ValueError(f"{type(config).__name__}'s tensor-parallel plan uses styles this toolkit does not implement "
                         f"({listed}); supported: {', '.join(sorted(known))}")


def _base_attribute(model: nn.Module) -> str:
    """The attribute of a causal LM holding its base model: its `base_model_prefix` (Llama 4 names one it does
    not use: then its one transformers-model child), or "" for a bare base model."""
    from transformers import PreTrainedModel

    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    bases = [name for name, child in model.named_children() if isinstance(child, PreTrainedModel)]
    return bases[0] if len(bases) == 1 else ""


def _is_vocab(style: str) -> bool:
    return style == "vocab" or STYLE_ALIASES.get(style) == "vocab"


def _with_experts(rules: dict[str, str], config, prefix: str, model: nn.Module | None, *,
                  split_over_tp: bool) -> dict[str, str]:
    """The tp rules with the experts modules' rules in place of those inside them: the ep plan's
    (`ep_dispatch_experts`; without one, the tp plan's `moe_tp_experts`), each expert split over tp where
    `split_over_tp` and the experts allow it. `model` (None where it cannot be built): rules matching none
    of its modules are left out (DeepSeek-V2-Lite's q_b_proj, where the queries have no latent)."""
    ep_rules = {(f"{prefix}.{k}" if prefix else k): v for k, v in (getattr(config, "base_model_ep_plan", None) or {}).items()}
    experts = [k for k, v in ep_rules.items() if STYLE_ALIASES.get(v) == "expert_parallel"]
    experts = experts or [k for k, v in rules.items() if STYLE_ALIASES.get(v) == "expert_tensor_parallel"]
    if not experts:
        return rules
    inside = [k for k in rules if any(k == e or k.startswith(e + ".") for e in experts)]
    kept = {k: v for k, v in rules.items() if k not in inside}
    if model is not None:  # a rule may name a module, or a bare parameter (attention sinks)
        names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
        kept = {k: v for k, v in kept.items() if any(match_pattern(k, n) for n in names)}
    split = [e for e in experts if split_over_tp and STYLE_ALIASES.get(rules.get(e, "")) == "expert_tensor_parallel"]
    split = [e for e in split if model is not None and _splits_over_tp(model, e)]  # where they add up so split
    return {**kept, **{e: "expert_tensor_parallel" if e in split else "expert_parallel" for e in experts}}


def _splits_over_tp(model: nn.Module, pattern: str) -> bool:
    """Whether every experts module `pattern` names splits each expert over tp as the family's tp plan says."""
    found = [(n, m) for n, m in model.named_modules() if n and match_pattern(pattern, n)]
    for fqn, module in found:
        layout = tp_layout(model, fqn, module)
        if isinstance(layout, str) or split_problem(model, fqn, layout):
            return False
    return bool(found)


def _replicas(ep: int, tp: int) -> int:
    """The fewest dp replicas whose dp x tp ranks an ep group fits in: ep / gcd(ep, tp) (ep 4 at tp 2: 2)."""
    return ep // math.gcd(ep, tp) if isinstance(ep, int) and isinstance(tp, int) and ep > 0 and tp > 0 else ep
