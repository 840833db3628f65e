-- SQLite migration 8: an attempt carries its own id (herald.deliveries.Attempted.id), chosen by
-- the notifier before it first records the attempt. A record whose answer was lost (the commit
-- made, the notifier told otherwise) is recorded again; a store that already holds an attempt
-- of that id for the delivery writes nothing then, so one POST is one row of the delivery's
-- history. Attempts recorded before have none (NULL). No index: the check reads the
-- delivery's own attempts through the primary key (delivery_id, n), inside the write lock.
ALTER TABLE webhook_attempts ADD COLUMN attempt_id TEXT;
