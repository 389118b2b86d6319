"""A LoRA plan read by `from_pretrained`: a Hugging Face base and a PEFT adapter directory, each rank reading its
slices, against PEFT's own `PeftModel.from_pretrained` in one process; fresh adapters drawn as `apply_plan` draws
them; an adapter that does not fit the plan refused on every rank."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import rewrite
from rewrite.binding.lora_targets import is_adapter
from rewrite.run.parity import reference_step
from tests.asserts import assert_close
from tests.distributed.lora.test_lora_parity import LORA, VOCAB, _plan, tiny
from tests.lora_oracle import Renamed, peft_twin, twin_names
from tests.multiproc import run
from tests.reference import assert_grads_match, expected_shard


def _batch():
    gen = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(2)]
    return ids, [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(2)]


def _read(rank: int, world: int, base: str, adapter: str, cases: list) -> list[str]:
    import peft

    done = []
    for name, options in cases:
        model = tiny()
        plan = _plan(model, **options)
        twin = peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter, is_trainable=True)
        reference = copy.deepcopy(model)  # for the names: adapters put on it as PEFT holds them
        peft_twin(reference, rank=LORA["rank"], alpha=LORA["alpha"])
        names = twin_names(reference, twin)
        stage = rewrite.from_pretrained(base, plan, adapter=adapter)
        ids, targets = _batch()
        per = len(ids) // stage.dp
        mine = slice(per * stage.dp_rank, per * (stage.dp_rank + 1))
        loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
        assert_close(f"{name} loss", loss, reference_step(twin, ids, targets))
        assert assert_grads_match(stage.model, Renamed(twin, names), prefix=f"{name} ") > 0
        assert all(p.grad is None for n, p in stage.model.named_parameters() if not is_adapter(n)), name
        done.append(name)
    # Without an adapter: drawn as apply_plan draws them on the whole model, whatever the plan.
    model = tiny()
    whole = rewrite.apply_plan(copy.deepcopy(model), {"lora": LORA, "mesh": {"dp": world}})
    drawn = rewrite.from_pretrained(base, _plan(model, tp=world))
    fresh = dict(whole.model.named_parameters())
    for n, p in drawn.model.named_parameters():
        if is_adapter(n):
            want = fresh[n].full_tensor() if hasattr(fresh[n], "full_tensor") else fresh[n]
            assert torch.equal(p.detach(), expected_shard(drawn.model, n, want.detach())), n
    done.append("drawn")
    for bad_plan, words in [({**_plan(model, tp=world), "lora": {"rank": 8}}, "r=4, the plan's lora.rank is 8"),
                            ({**_plan(model, tp=world), "lora": {**LORA, "targets": ["model.layers.*.self_attn.q_proj"]}},
                             "which the plan's lora.targets does not name")]:
        try:
            rewrite.from_pretrained(base, bad_plan, adapter=adapter)
        except rewrite.CheckpointError as exc:
            assert words in str(exc), exc
        else:
            raise AssertionError(f"from_pretrained read an adapter that does not fit: {words}")
    done.append("refused")
    return done


def test_from_pretrained_reads_a_peft_adapter_under_any_plan(tmp_path):
    model = tiny()
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    model.save_pretrained(base)
    peft_twin(copy.deepcopy(model), rank=LORA["rank"], alpha=LORA["alpha"]).save_pretrained(adapter)
    assert (Path(adapter) / "adapter_model.safetensors").is_file()
    cases = [("tp2", {"tp": 2}), ("dp2 full", {"dp": 2}), ("pp2", {"pp": 2})]
    done = run(_read, 2, str(base), str(adapter), cases, timeout_s=240)
    assert all(len(d) == len(cases) + 2 for d in done), done
