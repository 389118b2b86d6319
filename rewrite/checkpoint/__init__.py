"""Checkpoints: one standard Hugging Face checkpoint written from any plan (`hf_save`)
and loaded under any plan, each rank reading only its slices (`hf_load`).

`training_state`: resumable training state (DCP) whose `pieces` reshard across plans;
`export`: a training checkpoint to a plain HF one. `layout`: which rank holds which slice of which tensor; `headers`: what a checkpoint's
index and safetensors headers say (save ids, dtypes) before any tensor is read;
`swap`: replacing a checkpoint directory all at once.
"""

from ..errors import InputError


def refuse_context_parallel(cp: int, what: str) -> None:
    """Raise on every rank alike (the plan is the same everywhere) while checkpoints of a context-parallel
    stage are not built."""
    if cp > 1:
        raise InputError(f"{what}: mesh.cp={cp}: checkpoints (Hugging Face and training state) are not written or "
                         "read under context parallelism yet; train with cp from preset or config weights and without "
                         "--ckpt / --export, or use cp 1")
