"""The safetensors format, read and written by d9d.states itself (headers checked, data streamed)."""
