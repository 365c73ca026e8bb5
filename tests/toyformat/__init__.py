"""A toy checkpoint format, registered only by the tests: the proof that a new format is one
folder. Nothing outside this folder knows it."""
