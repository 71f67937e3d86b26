"""Framework integrations (Lightning, Hugging Face Trainer)."""
