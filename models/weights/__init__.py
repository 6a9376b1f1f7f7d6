"""Checkpoint readers that turn files on disk into Hugging Face named float32 parameters."""
