"""Running rewrite: the `rewrite` command, its train loop, tiny model presets, the
single-process parity check, and `launch` for notebooks. Nothing else imports this.
"""
