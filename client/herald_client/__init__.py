"""Herald client library."""
