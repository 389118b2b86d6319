"""What rewrite knows of model families, with no process group in sight.

`hf_decoder`: the module walker for Hugging Face decoder-only models, LLaMA, GPT-NeoX, GPT-J and
the rest (where the embeddings, layers, norm and head are, and how to run a slice of the layers).
`fx_graph`: any other module, traced by torch.fx and split where one tensor flows.
"""
