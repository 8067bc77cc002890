"""The example scripts, run as a user runs them."""
