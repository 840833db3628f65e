"""Herald core: settings, job store, outbox relay, result store and process supervision."""

__version__ = "0.1.0"
