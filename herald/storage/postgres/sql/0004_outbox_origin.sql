-- PostgreSQL migration 4: which process committed an outbox row; its relay publishes it
-- (outbox_batch). The pool sets herald.origin on each of its sessions (PgDatabase), so the
-- functions that insert outbox rows need no change.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS origin TEXT DEFAULT current_setting('herald.origin', true);
