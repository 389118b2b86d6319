"""The oracle guard: the module walker's stages must give the model's own logits.

The walker runs a Hugging Face model as embed -> layers -> norm -> head, in slices; a family whose
forward does more (a scale, a soft cap, an extra norm, rotary embeddings per layer type) would train as
a different model without a word. So before a plan is bound, the walker is checked against the model's
own `forward` on a tiny clone of the config (`tiny_clone`): random weights and ids, one process, no
collective. A mismatch, or a walker that cannot run the clone, is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache

import torch
from torch import nn

from .blocks import ATTENTION
from .families import set_local_kv_groups
from .hf_decoder import find_backbone, run_backbone
from .names import general_path
from .tiny_clone import config_value, tiny_clone_key, tiny_run

__all__ = ["exception_line", "on_tiny_clone", "perturbed", "walker_problem", "narrowed_problem", "packing_problem",
           "PACKED_LEAK", "TOLERANCE"]

TOLERANCE = 1e-4  # on float32 logits of a tiny model: float noise is ~1e-6, a dropped transform ~1e-2 or more
PACKED_LEAK = "lets one packed document reach the next"  # in packing_problem's words; cp refuses such a family


def walker_problem(model: nn.Module) -> str | None:
    """Why the module walker cannot stand in for `model`'s own forward, or None when it gives its logits.

    On a tiny clone: all layers in one stage, and in two, against `model_class(clone)(input_ids).logits`;
    cached per model class and clone config; the global RNG is left as it was.
    """
    return on_tiny_clone(model, "the module walker against", _check)


def on_tiny_clone(model: nn.Module, what: str, check: Callable[..., str | None], *args,
                  sizes: Mapping[str, int] | None = None) -> str | None:
    """`check(model class, tiny clone config, *args)`, cached per model class, clone and arguments; or why `model`'s
    config has no tiny clone. `sizes` replaces the clone's values of those config fields it has (expert counts)."""
    config = model.config
    try:
        key = tiny_clone_key(config)
    except Exception as exc:  # a config class that cannot be shrunk: nothing can be proven
        return f"cannot build a tiny {config.model_type} config to check {what} ({exception_line(exc)})"
    return _cached(check, type(model), type(config), key, tuple((sizes or {}).items()), args)


@lru_cache(maxsize=256)
def _cached(check: Callable[..., str | None], model_class: type, config_class: type, key: str, sizes: tuple,
            args: tuple) -> str | None:
    data = json.loads(key)
    return check(model_class, config_class.from_dict({**data, **{k: v for k, v in sizes if k in data}}), *args)


def perturbed(model_class: type, config) -> nn.Module:
    """A float32 model in eval mode, its parameters off their constant initial values (ones, zeros), so each counts."""
    tiny = model_class(config).float().eval()
    for param in tiny.parameters():
        param.add_(torch.randn_like(param) * 0.1)
    return tiny


def _stages(tiny: nn.Module, bb, ids: torch.Tensor, n: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The walker's logits of `n` layers: all in one stage, and split into two."""
    whole = run_backbone(tiny, bb, ids, list(range(n)), first=True, last=True, **kwargs)
    hidden = run_backbone(tiny, bb, ids, list(range(n // 2)), first=True, last=False, **kwargs)
    return whole, run_backbone(tiny, bb, hidden, list(range(n // 2, n)), first=False, last=True, **kwargs)


def _check(model_class: type, config) -> str | None:
    family = config.model_type
    with tiny_run():
        try:
            tiny = perturbed(model_class, config)
            ids = torch.randint(0, config.vocab_size, (2, 8))
            reference = tiny(input_ids=ids, use_cache=False).logits
        except Exception as exc:
            return f"cannot run a tiny {family} model to check the module walker against ({exception_line(exc)})"
        bb = find_backbone(tiny)
        if bb is None or not bb.has_head:
            return None  # the walker does not run it (a base model has no logits to compare): nothing to prove
        try:
            whole, split = _stages(tiny, bb, ids, bb.num_layers)
        except Exception as exc:
            return f"the module walker cannot run {family}'s layers ({exception_line(exc)})"
    if any(got.shape != reference.shape for got in (whole, split)):
        return (f"the module walker's stages do not give {family}'s own logits (shape {tuple(whole.shape)}, its own "
                f"{tuple(reference.shape)}): {model_class.__name__}.forward changes the head's output")
    worst = max((got - reference).abs().max().item() for got in (whole, split))
    if worst <= TOLERANCE:
        return None
    return (
        f"the module walker's stages do not give {family}'s own logits (max |difference| {worst:.3g} on a tiny "
        f"{family} model with this config's flags, tolerance {TOLERANCE:g}): {model_class.__name__}.forward does more "
        "than embeddings -> layers -> norm -> head (a scale, a soft cap, an extra norm, or inputs of its own to "
        "the layers)"
    )


def packing_problem(model: nn.Module) -> str | None:
    """Why `model` cannot train on packed documents (`position_ids` restarting at 0), or None when it can.

    On a tiny clone: the model's own forward with packed positions must give a document the logits it
    has alone (a convolution or recurrent layer may carry state across), and the walker with the same
    positions, whole and in two stages, the model's own logits.
    """
    return on_tiny_clone(model, "packed documents against", _packing)


def _packing(model_class: type, config) -> str | None:
    family = config.model_type
    with tiny_run():
        try:
            tiny = perturbed(model_class, config)
        except Exception as exc:
            return f"cannot build a tiny {family} model to check packed documents on ({exception_line(exc)})"
        ids = torch.randint(0, config.vocab_size, (1, 8))
        positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # two documents, of 3 and 5 tokens
        try:
            packed = tiny(input_ids=ids, position_ids=positions, use_cache=False).logits
            alone = tiny(input_ids=ids[:, 3:], use_cache=False).logits
        except Exception as exc:
            return f"{family}'s own forward does not run on packed documents ({exception_line(exc)})"
        leak = (packed[:, 3:] - alone).abs().max().item()
        if leak > TOLERANCE:
            return (f"{family}'s own forward {PACKED_LEAK} (max |difference| {leak:.3g} from the "
                    "document alone: a convolution or recurrent layer carries state across them, or its attention "
                    "does not read the documents' mask); pass one document a row (token ids without position_ids)")
        bb = find_backbone(tiny)
        if bb is None or not bb.has_head:
            return None  # the walker does not run it: its own forward, checked above, is what trains
        try:  # the walker's layers, not the config's count: a family may hold more modules than it names layers
            whole, split = _stages(tiny, bb, ids, bb.num_layers, position_ids=positions)
        except Exception as exc:
            return f"the module walker cannot run {family}'s layers on packed documents ({exception_line(exc)})"
    worst = max((got - packed).abs().max().item() for got in (whole, split))
    if worst > TOLERANCE:
        return (f"the module walker's stages do not give {family}'s own logits on packed documents (max |difference| "
                f"{worst:.3g}); pass one document a row (token ids without position_ids)")
    return None


def narrowed_problem(model: nn.Module, styles: Mapping[str, str], replicated: Iterable[str] = ()) -> str | None:
    """Why `model`'s own forward cannot run on one tensor-parallel rank's shards, or None when it can.

    A family that reshapes by its full head count (`self.num_heads`) crashes once q/k/v hold 1/tp of the
    heads. On a tiny clone, each 'column' linear keeps half its rows and each 'row' one half its columns,
    as on one rank of tp 2, and the model's own forward runs on a few ids. With k/v projections
    `replicated`, the clone is cut as on one rank of tp 4 with one whole kv head, its attention told so
    (`set_local_kv_groups`). Only shapes are checked: the values are another rank's business.
    """
    kv = {general_path(fqn) for fqn in replicated}
    narrowed = frozenset(
        (general_path(fqn), "kv" if general_path(fqn) in kv else "row" if style == "row" else "column")
        for fqn, style in styles.items() if style in ("column", "packed_column", "row")
    )
    if not narrowed:
        return None
    return on_tiny_clone(model, "its sharded forward against", _narrowed, narrowed)


def _narrowed(model_class: type, config, narrowed: frozenset) -> str | None:
    styles = dict(narrowed)
    with tiny_run():
        try:
            tiny = model_class(config).float().eval()
        except Exception as exc:
            return f"cannot build a tiny {config.model_type} model to check its sharded forward against ({exception_line(exc)})"
        tp = 4 if "kv" in styles.values() else 2  # the clone's 4 query heads, one per rank, past its kv heads
        head_dim = config_value(config, "head_dim") or config.hidden_size // config.num_attention_heads
        for fqn, module in list(tiny.named_modules()):
            style = styles.get(general_path(fqn))
            if style is None or not isinstance(module, nn.Linear):
                continue
            inputs, outputs = {
                "column": (module.in_features, module.out_features // tp),
                "row": (module.in_features // tp, module.out_features),
                "kv": (module.in_features, head_dim),  # one whole kv head
            }[style]
            parent, _, leaf = fqn.rpartition(".")
            setattr(tiny.get_submodule(parent) if parent else tiny, leaf, nn.Linear(inputs, outputs, bias=module.bias is not None))
        for fqn, param in list(tiny.named_parameters()):  # bare per-head parameters split with the heads (sinks)
            if styles.get(general_path(fqn)) == "column":
                parent, _, leaf = fqn.rpartition(".")
                setattr(tiny.get_submodule(parent), leaf, nn.Parameter(param.detach()[: param.shape[0] // tp].clone()))
        for fqn, module in tiny.named_modules():
            if styles.get(general_path(f"{fqn}.{ATTENTION.kv[0]}")) == "kv":
                set_local_kv_groups(module, config.num_attention_heads // tp, 1)
        ids = torch.randint(0, config.vocab_size, (2, 8))
        try:
            model_class(config).eval()(input_ids=ids, use_cache=False)
        except Exception as exc:  # the clone itself does not run: nothing about tp can be said
            return f"cannot run a tiny {config.model_type} model to check its sharded forward against ({exception_line(exc)})"
        try:
            tiny(input_ids=ids, use_cache=False)
        except Exception as exc:
            return (
                f"{model_class.__name__}.forward fails on one rank's shards of its split linears ({exception_line(exc)}): its "
                "layers reshape by the full head or feature count; leave its attention and MLP unsharded (mesh.tp: 1)"
            )
    return None


def exception_line(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
