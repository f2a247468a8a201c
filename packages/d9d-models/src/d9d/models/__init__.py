"""Model building blocks and the d9d model catalogue (Qwen3 dense and MoE)."""
