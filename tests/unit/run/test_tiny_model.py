"""`make_tiny_checkpoint`: a tokenizer and model directory that transformers loads as is."""

from __future__ import annotations

import math

import pytest
import torch

from rewrite.run.byte_data import default_data_path
from rewrite.run.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def test_loads_with_transformers(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (checkpoint / "model.safetensors").is_file()
    assert model.config.vocab_size == len(tokenizer) == 512
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)


@pytest.mark.parametrize(
    "text", ["Alice was beginning to get very tired.", "  two  spaces, a tab\tand\nnew lines .\n", "~{}|^`@#$%&*()", ""]
)
def test_tokenizer_round_trips_text(checkpoint, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.encode(text)
    assert tokenizer.bos_token_id not in ids and tokenizer.eos_token_id not in ids  # encoding adds no specials
    assert tokenizer.decode(ids) == text


def test_bpe_merges_shorten_the_text(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = default_data_path().read_text()[:5000]
    assert len(tokenizer.encode(text)) < 0.6 * len(text.encode())


def test_random_init_loss_is_near_log_vocab(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer.encode(default_data_path().read_text()[2000:4000])[:128]
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert abs(loss - math.log(512)) < 0.3, loss


def test_same_seed_same_files_other_seed_other_weights(checkpoint, tmp_path):
    again = make_tiny_checkpoint(tmp_path / "again")
    other = make_tiny_checkpoint(tmp_path / "other", seed=1)
    files = sorted(p.name for p in checkpoint.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (again / name).read_bytes() == (checkpoint / name).read_bytes(), name
    assert (other / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (checkpoint / "model.safetensors").read_bytes()


@pytest.mark.parametrize("preset", ["tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_other_presets_data_and_vocab_size(tmp_path, preset):
    from transformers import AutoConfig, AutoTokenizer

    text = tmp_path / "small.txt"
    text.write_text("the cat sat on the mat, the dog sat on the log. " * 50)
    out = make_tiny_checkpoint(tmp_path / "model", preset=preset, data=text, vocab_size=300)
    config, tokenizer = AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert config.model_type == preset.removeprefix("tiny-")
    # the class transformers picks for the model type adds no tokens beyond the embedding
    assert config.vocab_size == len(tokenizer) < 300  # the short text runs out of merges
    assert (tokenizer.unk_token_id, tokenizer.pad_token_id) == (None, None)
    text = "the zebra, 1865: don't!"  # unseen letters and digits still encode
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bad_arguments_are_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        make_tiny_checkpoint(tmp_path / "a", preset="nope")
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small.*--vocab-size >= 258"):
        make_tiny_checkpoint(tmp_path / "b", vocab_size=100)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"not an empty directory \(found: config.json\)"):
        make_tiny_checkpoint(tmp_path / "full")


def test_init_model_command_writes_a_loadable_directory(tmp_path, capsys):
    from rewrite.run.cli import main

    assert main(["init-model", str(tmp_path / "m"), "--vocab-size", "300"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "m").iterdir()}
    assert main(["init-model", str(tmp_path / "m")]) == 1  # not over an existing model
