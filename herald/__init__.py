"""Herald core: settings, job store, outbox relay, result store: what every service stands on."""

__version__ = "0.1.0"
