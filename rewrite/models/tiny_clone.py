"""A tiny clone of a model's config: the same class, flags and multipliers at tiny sizes (64 hidden, 4 heads,
4 layers, a 128-token vocabulary), on which the guards (`oracle`, `expert_split`, context parallelism's family
check) run the model's own forward in one process; and the key their answers are cached by.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..values import is_int

__all__ = ["config_value", "per_head_sizes", "small_chunks", "tiny_clone_config", "tiny_clone_key", "tiny_run"]

_LAYERS = 4  # the clone's layers: enough for each attention type and a two-stage split
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # in the tiny vocabulary
_SIZES = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 128, "head_dim": 16}


@contextmanager
def tiny_run() -> Iterator[None]:
    """The global RNG left as it was, no autograd, one intra-op thread: a tiny clone's matmuls gain nothing
    from a thread pool, and on a busy machine each hand-off to it costs ~10 ms (a whole check 1-2 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            yield
    finally:
        torch.set_num_threads(threads)


def _clone_layers(config) -> list[int]:
    """Which of the config's layers the clone keeps: the first of each attention type, then in order."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != n:
        return list(range(min(n, _LAYERS)))
    firsts = [types.index(t) for t in dict.fromkeys(types)]
    rest = [i for i in range(n) if i not in firsts]
    return sorted((firsts + rest)[: max(min(n, _LAYERS), len(firsts))])


def per_head_sizes(config) -> dict[str, int]:
    """The config's other sizes per head, shrunk by the tiny head_dim's share of its own (even, >= 2): GPT-J's
    `rotary_dim`, multi-head latent attention's `qk_rope_head_dim`, `v_head_dim`, `kv_lora_rank`, ..."""
    data = config.to_dict()
    heads = config_value(config, "num_attention_heads") or 4  # attribute names: GPT-J stores n_head, n_embd
    head_dim = config_value(config, "head_dim") or ((config_value(config, "hidden_size") or 0) // heads) or _SIZES["head_dim"]
    scaled = [k for k, v in data.items() if is_int(v) and (
        k == "rotary_dim" or (k.endswith("_head_dim") and k != "head_dim") or k.endswith("_lora_rank"))]
    return {k: max(2, 2 * round(data[k] * _SIZES["head_dim"] / head_dim / 2)) for k in scaled}


def small_chunks(config) -> dict[str, int]:
    """The config's scan chunk lengths (`mamba_chunk_size`, `chunk_size`) cut to 16: a reference scan pads
    the sequence to a whole chunk, so a tiny run with Mamba's 256 costs seconds a step for the same sums."""
    return {k: 16 for k, v in config.to_dict().items() if k.endswith("chunk_size") and is_int(v) and v > 16}


def config_value(config, key: str):
    """`config.key`, or None when absent or not one value (Gemma-4 keeps some per layer and raises)."""
    try:
        return getattr(config, key, None)
    except Exception:  # a per-layer attribute read globally (Gemma-4): no one value
        return None


def tiny_clone_config(config):
    """A config of the same class with the same flags and tiny sizes (64 hidden, 4 heads, 4 layers).

    Per-layer lists (`layer_types`, ...) keep the kept layers' entries, so every attention type appears;
    kv heads keep their kind (as many as the query heads, one, or fewer); token ids move inside the vocabulary.
    """
    data = config.to_dict()
    n, keep = config.num_hidden_layers, _clone_layers(config)
    for key, value in list(data.items()):
        if isinstance(value, list) and len(value) == n and n > 1:
            data[key] = [value[i] for i in keep]
    heads = getattr(config, "num_attention_heads", None) or 4
    kv = getattr(config, "num_key_value_heads", None) or heads
    data.update(per_head_sizes(config))
    data.update(small_chunks(config))
    data.update({key: size for key, size in _SIZES.items() if key in data or key != "head_dim"})
    data.update(num_hidden_layers=len(keep), num_attention_heads=4, num_key_value_heads=4 if kv == heads else 1 if kv == 1 else 2)
    if data.get("sliding_window") is not None:
        data["sliding_window"] = 4  # shorter than the ids, so the window matters
    for key, tiny_id in _TOKEN_IDS.items():  # kept an int (strict configs want one), inside the tiny vocabulary
        value = data.get(key)
        if isinstance(value, int) and not 0 <= value < _SIZES["vocab_size"]:
            data[key] = tiny_id
        elif isinstance(value, list):
            data[key] = [v if isinstance(v, int) and 0 <= v < _SIZES["vocab_size"] else tiny_id for v in value]
    data.pop("quantization_config", None)
    return type(config).from_dict(data)


_CLONE_KEYS: dict[tuple, str] = {}


def tiny_clone_key(config) -> str:
    """`tiny_clone_config(config)` as sorted JSON: the key the checks on a tiny clone are cached by.
    Remembered per config value (a plan search asks per candidate and experts module; `to_dict` takes ms)."""
    seen = (type(config), repr(sorted(vars(config).items(), key=lambda item: item[0])))
    if seen not in _CLONE_KEYS:
        if len(_CLONE_KEYS) >= 64:
            _CLONE_KEYS.clear()
        _CLONE_KEYS[seen] = json.dumps(tiny_clone_config(config).to_dict(), sort_keys=True, default=str)
    return _CLONE_KEYS[seen]


