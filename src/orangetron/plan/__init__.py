"""Cost model and layout search. Pure Python: importable without torch.distributed."""
