"""Offline test fixtures: tiny random-weight models of every family (`vtc.testing.tiny`)."""
