"""vtc_plugins: one module per compression method (plus baselines), each a pluggy plugin.

Every module reads top to bottom as: docstring (paper, official repo, idea, stages), a parameter
dataclass with the official defaults, the algorithm as pure tensor functions, and a thin plugin class
whose stage hooks call them. `vtc_register_methods` at the bottom tells vtc about it.
"""
