"""Checkpoints: one standard Hugging Face checkpoint written from any plan
(`hf_save`), and loaded under any plan, each rank reading only its slices (`hf_load`).
"""
