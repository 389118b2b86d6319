"""Checkpoints: one standard Hugging Face checkpoint written from any plan (`hf_save`) and loaded
under any plan, each rank reading only its slices (`hf_load`; what it checks first: `headers`).

`training_state`: resumable training state (DCP) whose `pieces` reshard across plans; `export`: a
training checkpoint to a plain HF one. `layout`: which rank holds which slice of which tensor;
`swap`: replacing a checkpoint directory all at once.
"""
