"""`rewrite train --export DIR`: the trained model written out once the run ends."""

from __future__ import annotations

import torch.distributed as dist

from ..agreement import share
from ..checkpoint.training_state import latest_checkpoint
from .byte_data import TrainConfigError

__all__ = ["export_trained"]


def export_trained(stage, plan, tokenizer, out_dir: str, ckpt: str | None = None, last: int = 0) -> None:
    """A plain Hugging Face checkpoint of the trained model (collective: each stage sends its part); a LoRA
    run's adapters as a PEFT adapter directory, from the training state saved after the last step."""
    from ..checkpoint.export import export_checkpoint
    from ..checkpoint.hf_save import save_pretrained

    if plan.lora is not None:
        failed = None
        if dist.get_rank() == 0:
            try:
                found = latest_checkpoint(ckpt)
                if found is None or found[0] != last:
                    raise ValueError(f"the latest training state in {ckpt} is "
                                     f"{'none' if found is None else f'of step {found[0]}'}, the run ended at step "
                                     f"{last}; export that step's with `rewrite export {ckpt} DIR --adapter-only`")
                export_checkpoint(found[1], out_dir, adapter_only=True)
            except (ValueError, OSError) as exc:
                failed = str(exc)
        failed = share(failed)[0]  # rank 0's word: every rank raises alike, none waits
        if failed is not None:
            raise TrainConfigError(f"rewrite train: --export {out_dir}: {failed}")
    else:
        save_pretrained(stage, plan, out_dir)
    if dist.get_rank() == 0:
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        print(f"exported {out_dir}", flush=True)
