"""Plans as data: the schema, plan files, HF tp_plan import, binding to a model, `show` tables.

Pure: nothing here creates a process group or imports torch.distributed, so a plan
can be checked against a meta-device model on a laptop.
"""
