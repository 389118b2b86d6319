"""The routers' auxiliary loss as sums a pipeline carries (`models.router_loss`): the pooled sums of stages'
layers give the family's own `load_balancing_loss_func`, value and gradient of every layer's logits, for
every family of the installed transformers that has one; a family whose function is another is refused."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import rewrite
from rewrite.models.router_loss import _is_pooled_balance, balance, pooled, router_loss_parts
from tests.asserts import assert_close
from tests.families import tiny_moe_model


# Families whose load_balancing_loss_func is not Switch's pooled balance: Doge's retrieved experts (a product-key
# loss), and the encoder-decoder Switch Transformers (its routers' probabilities and choices as given).
OTHER_LOSSES = {"doge", "switch_transformers"}


def _families_with_the_loss() -> list[str]:
    import transformers.models as models

    root = Path(models.__file__).parent
    return sorted(p.parent.name for p in root.glob("*/modeling_*.py")
                  if p.name == f"modeling_{p.parent.name}.py" and "def load_balancing_loss_func" in p.read_text())


def _stages_loss(layers: list[torch.Tensor], cuts: list[int], experts: int, top_k: int, coef: float):
    """The loss as the runner counts it over stages cut at `cuts`: the last stage's value, every stage's gradient."""
    parts = [pooled(layers[a:b], experts, top_k) for a, b in zip([0, *cuts], [*cuts, len(layers)])]
    total = sum(p.values for p in parts)
    losses = [balance(total, p.probs, coef, experts) for p in parts]
    for extra in losses[:-1]:  # a middle stage's loss: its gradient only
        extra.backward(retain_graph=True)
    losses[-1].backward()
    return losses[-1].detach()


@pytest.mark.parametrize("family", _families_with_the_loss())
def test_stage_sums_give_the_family_loss_and_gradients(family):
    fn = importlib.import_module(f"transformers.models.{family}.modeling_{family}").load_balancing_loss_func
    experts, top_k, coef = 8, 2, 0.25
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(12, experts, generator=gen) * 2 for _ in range(5)]
    if family in OTHER_LOSSES:  # refused: router_loss_parts reads them as not the pooled balance
        assert not _is_pooled_balance(fn, experts, top_k), family
        return
    assert _is_pooled_balance(fn, experts, top_k), family
    want_layers = [t.clone().requires_grad_() for t in logits]
    want = coef * fn(tuple(want_layers), experts, top_k, None)
    want.backward()
    for cuts in ([], [2], [1, 3], [1, 2, 3, 4]):
        layers = [t.clone().requires_grad_() for t in logits]
        got = _stages_loss(layers, cuts, experts, top_k, coef)
        assert_close(f"{family} cut at {cuts}: loss", got, want.detach(), rtol=1e-6, atol=1e-7)
        for i, (a, b) in enumerate(zip(layers, want_layers)):
            assert_close(f"{family} cut at {cuts}: layer {i}'s gradient", a.grad, b.grad, rtol=1e-5, atol=1e-8)


def test_a_family_counted_another_way_is_refused(monkeypatch):
    model = tiny_moe_model("mixtral", output_router_logits=True)
    parts = router_loss_parts(model)
    assert parts.experts == 4 and parts.top_k == 2 and parts.coef == model.config.router_aux_loss_coef
    for plan in ({"mesh": {"pp": 2}}, {"mesh": {"cp": 2}}, {"mesh": {"pp": 2, "dp": 2, "ep": 2},
                                                            "tensor_parallel": {"model.layers.*.mlp.experts": "expert_parallel"}}):
        assert rewrite.resolve(plan, model).stages  # across stages and sequence shards: counted
    module = sys.modules[type(model).__module__]
    per_layer = lambda logits, e, k, mask: sum(torch.softmax(t, -1).max(-1).values.mean() for t in logits)  # noqa: E731
    monkeypatch.setattr(module, "load_balancing_loss_func", per_layer)
    with pytest.raises(ValueError) as refused:
        rewrite.resolve({"mesh": {"pp": 2}}, model)
    assert ("MixtralForCausalLM's load_balancing_loss_func is not Switch's balance over every layer's rows pooled"
            in str(refused.value))
    assert "set config.output_router_logits = False" in str(refused.value)
