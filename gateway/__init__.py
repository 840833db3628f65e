"""The HTTP API (Litestar), plus the relay, sweeper and live hub that run beside it."""
