"""Integrations with training frameworks: torch.distributed.checkpoint, plain loops, verl.

Each module imports its framework itself, so importing ckptstore never pulls them in.
"""
