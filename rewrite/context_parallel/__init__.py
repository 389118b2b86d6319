"""Context parallelism: each of cp ranks holds `seq / cp` tokens of every microbatch.

`shard.py` says which tokens (two chunks a rank, balanced for the causal mask), `collectives.py` gathers
keys and values, `attention.py` is the attention function the model's layers call through transformers'
`AttentionInterface`. Knows no pipeline and no plan.
"""
