"""A small but real Hugging Face checkpoint made on the spot: a byte-level BPE tokenizer
trained on local text plus a preset model with random weights. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from .byte_data import default_data_path
from .init_mark import write_init_mark
from .presets import PRESETS, build_config, build_model
from .text_data import read_documents

__all__ = ["make_tiny_checkpoint"]

BOS, EOS = "<s>", "</s>"
# Each turn as "<|role|>\ncontent</s>"; the assistant's content and its </s> marked as generated
# (transformers' `return_assistant_tokens_mask` reads the marks); a generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_MIN_VOCAB = 256 + 2  # every byte, then <s> and </s>: byte-level BPE needs no <unk>


def make_tiny_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny-llama",
    data: str | Path | None = None,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Write a tokenizer and a randomly initialised model of `preset` to `out_dir`.

    The tokenizer is byte-level BPE (any text encodes, and decodes back unchanged) trained
    on `data` up to `vocab_size` tokens, with `<s>` as BOS and `</s>` as EOS; encoding adds
    neither. The model's `vocab_size` is the tokenizer's. The same arguments give the same
    files, byte for byte.

    Args:
        out_dir: where to write; created if missing, and must hold no files yet.
        preset: a name from `rewrite.run.presets.PRESETS`.
        data: text to train the tokenizer on, anything `read_documents` reads;
            default `data/alice29.txt`.
        vocab_size: the tokenizer's vocabulary, at least 258 (256 bytes and 2 specials);
            the text may support fewer merges, and then the vocabulary is smaller.
        seed: seeds the model's initial weights.
    Returns:
        `out_dir`, loadable with `AutoModelForCausalLM` and `AutoTokenizer.from_pretrained`.
    Raises:
        ValueError: an unknown preset, a too small vocab_size, or a non-empty `out_dir`.
        TrainConfigError: `data` cannot be read.

    Example:
        >>> out = make_tiny_checkpoint("tiny")  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained(out)  # doctest: +SKIP
    """
    out = Path(out_dir)
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; presets: {', '.join(PRESETS)}")
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: 256 bytes + {BOS} + {EOS} need {_MIN_VOCAB}; "
            f"pass --vocab-size >= {_MIN_VOCAB}"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        found = "a file" if not out.is_dir() else ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise ValueError(f"{str(out)!r} is not an empty directory (found: {found}); pass a new or empty directory")
    documents = read_documents(default_data_path() if data is None else data)
    tokenizer = _train_tokenizer(documents, vocab_size)
    config = build_config(
        preset,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.chat_template = CHAT_TEMPLATE  # conversations train with the assistant's turns counted
    model = build_model(config, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    model.save_pretrained(str(out))  # safetensors
    write_init_mark(out, preset=preset, seed=seed)  # `train` then starts it at the from-scratch learning rate
    _check_reloads(out, config)
    return out


def _check_reloads(out: Path, config) -> None:
    """Fail now if transformers would load a tokenizer that does not fit the model.

    `AutoTokenizer` picks its class from the model type, and some classes add tokens of
    their own (Qwen2's `<|endoftext|>`), whose ids the embedding would not have.
    """
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(out))
    found = (len(loaded), loaded.bos_token_id, loaded.eos_token_id)
    if found != (config.vocab_size, config.bos_token_id, config.eos_token_id):
        raise RuntimeError(
            f"{out}: transformers loads the tokenizer as {type(loaded).__name__} with (vocab, bos, eos) = {found}, "
            f"but the {config.model_type} model has {(config.vocab_size, config.bos_token_id, config.eos_token_id)}"
        )


def _train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE tokenizer, trained on `documents`, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    # Every byte is a symbol (GPT-2's byte-to-character map), so nothing is unknown and
    # decoding inverts encoding; no prefix space, or decode would add a leading " ".
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer)
    # clean_up_tokenization_spaces would turn " ." into "." and break the round trip.
    # unk and pad are saved as null: left unset, some model types' tokenizer classes add
    # a token of their own for them, beyond the model's vocabulary.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=None,
        pad_token=None,
        clean_up_tokenization_spaces=False,
    )
