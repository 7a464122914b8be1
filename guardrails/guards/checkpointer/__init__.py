"""SignalCheckpointer: signal, periodic and final saves, agreed by every rank, and the
resume at start.
"""
