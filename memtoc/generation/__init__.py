"""Models and their replies: the model registry, weights, chat templates, decoding policy, the reply
cache, the hardware checks, and the backends (``generation.backends``). Imports ``core`` only."""
