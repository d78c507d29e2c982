"""Checkpoint converters, both ways: TorchScale and fairseq-TorchScale checkpoints <-> LEX folders (torchscale),
Llama, Mistral and Qwen2 folders or .gguf files <-> LEX folders and models (hf)."""
