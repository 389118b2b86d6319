"""What a plan is: the schema, plan files and their line numbers, loading, HF tp_plan import, module patterns.
Pure: no process group. Binding a plan to a model is `rewrite.binding`.
"""
