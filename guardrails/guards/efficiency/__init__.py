"""Efficiency: FLOPs per step (MFU), host syncs in the loop, the fast-path advisor."""
