"""Context parallelism: each of cp ranks holds `seq / cp` tokens of every microbatch.

`shard.py` says which tokens (two chunks a rank, balanced for the causal mask), `attention.py` cuts a
microbatch into each rank's part, gathers keys and values, and is the attention function the model's layers
call through transformers' `AttentionInterface`. Knows no pipeline and no plan.
"""
