"""Exporting LoRA adapters in the layout Hugging Face `peft` loads."""

from d9d.peft.export.hf_peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_hf_peft_adapter, hf_peft_adapter_state

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_hf_peft_adapter", "hf_peft_adapter_state"]
