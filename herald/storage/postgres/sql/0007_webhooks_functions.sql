-- PostgreSQL migration 7: the webhook functions (keys, fan-out, finish). Their SQL left the
-- numbered migrations for functions/ (the key functions went altogether: migration 14).

-- herald_webhook_add_key was made here; migration 14 drops it from the databases that have it.

-- herald_webhook_ensure_key was made here; migration 14 drops it from the databases that have it.

-- herald_webhook_fan_out: its definition is functions/webhooks_fan_out.sql now (repeatable: applied whenever it changes).

-- herald_webhook_finish: its definition is functions/webhooks_finish.sql now (repeatable: applied whenever it changes).
