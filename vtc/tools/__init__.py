"""Command-line tools: `vtc methods`, `vtc run`, `vtc bench`, timing and model loading."""
