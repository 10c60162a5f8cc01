"""The batch-invariant CPU decode engine of the transformers backend (a leaf: only
``generation.backends.hf`` imports it): the compact decode loop, the row prefill, shared prefixes, the
CPU attention kernel and the stop rules."""
