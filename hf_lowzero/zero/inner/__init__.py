"""The inner optimizer: which way it owns state, its adoption onto the masters, the two sets of
param groups, its shard as torch's state dict, and chains of optimizers."""
