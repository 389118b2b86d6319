"""What a plan binds to on a model: `resolve` (stages, tp rules and shapes), where each rank's part of a
tensor lies (`shard_layout`), stage cuts, the walk over a rank's parameters. Pure: binds to a meta model.
"""
