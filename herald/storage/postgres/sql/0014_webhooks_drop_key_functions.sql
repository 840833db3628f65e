-- PostgreSQL migration 14: the key functions of migration 7 go. Key rotation and a key's
-- creation on first use are the rulebook's (herald.delivery_rules.rotate), written by
-- herald/storage/postgres/webhooks.py in plain statements under the owner's key lock; nothing
-- calls these any more. (A process of a Herald from before that change calls them: upgrade
-- every process together, as for migration 10.)
DROP FUNCTION IF EXISTS herald_webhook_add_key(TEXT, TEXT, BYTEA, BYTEA, DOUBLE PRECISION);
DROP FUNCTION IF EXISTS herald_webhook_ensure_key(TEXT, TEXT, BYTEA, BYTEA);
