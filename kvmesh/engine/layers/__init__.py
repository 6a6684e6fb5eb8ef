"""Building blocks the architectures in engine/models compose: linear methods, norms, rotary,
GQA and MLA attention, dense and mixture-of-experts MLPs."""
