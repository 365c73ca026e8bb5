"""The benches (``python -m bench list``); each suite also runs alone as a script."""
