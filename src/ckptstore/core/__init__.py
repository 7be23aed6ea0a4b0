"""The core every face calls: one coordinated save and one resolver.

``Coordinator`` (coordination.py) begins a save, hands each participant its plan, and commits or
discards the step once, under the save's deadline; ``Resolver`` (resolver.py) picks the step a
load starts from, over every tier, under the load's deadline. A face (one process, async,
torch.distributed, DCP, verl, the CLI) gets atomicity, tiers and deadlines by calling them.
"""
