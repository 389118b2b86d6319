"""What `rewrite show` draws: the plan's tables as text or JSON, the tensor-parallel options, the schedule."""
