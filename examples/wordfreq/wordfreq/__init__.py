"""A Herald job kind of its own: word frequencies of a posted text (see README.md)."""
