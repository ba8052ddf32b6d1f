"""The example: a character-level GPT (model.py, one file), its data (data.py) and its trainers (train*.py)."""
