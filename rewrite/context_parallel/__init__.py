"""Context parallelism: each of cp ranks holds `seq / cp` tokens of every microbatch.

`shard.py` says which tokens (two chunks a rank, balanced for the causal mask),
`collectives.py` gathers keys and values over the ranks (reduce-scattering their gradients),
`attention.py` is the attention function the model's own layers call through transformers'
`AttentionInterface`. This room knows no pipeline and no plan.
"""
