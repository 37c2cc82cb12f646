"""The write path: staged files and their journals, the no-blind-overwrite commit, and recovery
of what a crashed or failed commit left."""
