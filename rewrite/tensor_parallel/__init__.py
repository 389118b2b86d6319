"""Tensor parallelism: Column/Row parallel linears, their autograd collectives, and `apply_tensor_parallel`,
which swaps a bound plan's modules in place. Knows nothing of pipelines: a tp group is all it is given."""
