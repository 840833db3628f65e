"""A Herald job kind of its own that streams its output as it writes (see README.md)."""
