"""Low-rank adapters (LoRA): their arithmetic, the layer carrying one, and applying a plan's `lora` section."""

from .adapter import LoraLinear, init_adapter, lora_delta
from .apply import adapter_parameters, apply_lora
from .peft_format import from_peft_name, peft_name, put_adapters

__all__ = ["LoraLinear", "lora_delta", "init_adapter", "apply_lora", "adapter_parameters", "peft_name", "from_peft_name",
           "put_adapters"]
