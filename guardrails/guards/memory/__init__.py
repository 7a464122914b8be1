"""MemoryGuard: leaks, data starvation, out-of-memory errors explained."""
