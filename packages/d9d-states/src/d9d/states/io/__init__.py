"""Files on disk: safetensors headers, readers and writers, the HF index, checkpoint sources."""
