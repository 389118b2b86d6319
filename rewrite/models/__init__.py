"""What rewrite knows of model families, with no process group in sight.

`hf_llama`: the module walker for Hugging Face LLaMA-family models (where the
embeddings, layers, norm and head are, and how to run a slice of the layers).
`fx_graph`: any other module, traced by torch.fx and split where one tensor flows.
"""
