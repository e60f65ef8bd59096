"""Tiers of the block store: GPU memory, the shared DRAM arena, disk."""
