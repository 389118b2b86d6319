"""Numbers only, above `plan/`: activation and parameter memory per rank, and stage balance.

Pure: a resolved plan and its model (a meta-device one will do) in, bytes, counts and
warnings out; no process group. FLOPs per layer come from `rewrite.models.flops`.
"""
