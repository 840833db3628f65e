-- PostgreSQL migration 8: herald_webhook_finish_many.

-- herald_webhook_finish_many: its definition is functions/webhooks_finish.sql now (repeatable: applied whenever it changes).
