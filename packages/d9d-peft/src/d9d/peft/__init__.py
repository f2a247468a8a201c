"""Parameter-efficient fine-tuning for d9d: LoRA, full tune, stacking."""
