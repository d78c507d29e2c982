"""Checkpoint converters: TorchScale / fairseq-TorchScale <-> LEX Hugging Face folders."""
