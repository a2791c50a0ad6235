"""Wing: reading and writing files: safetensors, checkpoints, tokenizers, GPT-2 weights."""
