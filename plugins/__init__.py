"""vtc_plugins: the built-in methods, one module (or package) per compression method plus baselines; every `@vtc.method` class defined here is registered (`vtc.core.registry`).

Every module reads top to bottom as: docstring (paper, official repo, idea, stages), a parameter
dataclass with the official defaults, the algorithm as pure tensor functions, and a thin plugin class
whose stage hooks call them. `vtc_register_methods` at the bottom tells vtc about it.
"""
