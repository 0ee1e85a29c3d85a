"""vtc_plugins: the built-in methods, one module (or package) per compression method, plus baselines.

Every `@vtc.method` class defined here is registered (`vtc.core.registry`). A module reads top to bottom as:
docstring (paper, official repo, idea, stages, where vtc differs), the algorithm as pure tensor functions, and one
dataclass on a stage base (`vtc.TokenSelector`, `vtc.LayerPruner`, ...) whose fields are the official defaults.
"""
