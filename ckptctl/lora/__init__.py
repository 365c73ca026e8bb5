"""Merging LoRA adapters into a base checkpoint (``ckptctl merge-lora``)."""
