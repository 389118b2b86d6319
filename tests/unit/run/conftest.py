"""Fixtures the data tests share: a tiny Hugging Face checkpoint (byte-level BPE tokenizer with a
chat template, random tiny-llama weights), made once for the folder, and its tokenizer."""

from __future__ import annotations

import pytest

from rewrite.run.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="package")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="package")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)
