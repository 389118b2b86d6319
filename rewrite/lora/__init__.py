"""Low-rank adapters (LoRA): their arithmetic, the layer carrying one, and applying a plan's `lora` section."""

from .adapter import LoraLinear, init_adapter, lora_delta
from .apply import apply_lora, merge_adapters
from .peft_format import from_peft_name, peft_config, peft_name, put_adapters

__all__ = ["LoraLinear", "lora_delta", "init_adapter", "apply_lora", "merge_adapters", "peft_name", "from_peft_name",
           "put_adapters", "peft_config"]
