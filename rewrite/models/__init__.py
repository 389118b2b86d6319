"""What rewrite knows of model families, with no process group in sight: the Hugging Face decoder walker
(`hf_decoder`), any other module traced by torch.fx (`fx_graph`), and FLOPs from a config (`flops`)."""
