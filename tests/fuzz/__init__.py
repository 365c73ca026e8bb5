"""The fuzz suite's checkpoints and mutations (``tests/test_fuzz.py`` runs them)."""
