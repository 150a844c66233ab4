"""raytune_ft: Ray Train fine-tuning of Qwen-family LLMs."""
__version__ = "0.1.0"
