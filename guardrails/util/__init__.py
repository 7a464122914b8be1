"""Small helpers every layer uses, none of them torch-heavy: text, knob checks, file
modes and durability, storage errors in the user's terms, host probes. Private.
"""
