-- PostgreSQL migration 22: a delivery writes fewer index entries (issue 24, fewer writes per job).
--
-- A delivery row is inserted by the fan-out, then updated by its lease and by its finish; an
-- update that is not HOT writes an entry into every index again. pg_waldump of an e2e bench
-- run (bench/RESULTS.md) counted 24 WAL records per delivered job for this table, 17 of
-- them b-tree inserts into its ten indexes:
-- * the primary key on seq was never probed (idx_scan 0): seq orders an endpoint's log
--   through webhook_deliveries_by_endpoint, and identity makes it unique without an index;
--   id, unique already and what every statement finds a row by, is the primary key now;
-- * webhook_deliveries_pending_order (target, job_id, version) WHERE pending served the
--   claim's "no older version of the job pending for the target" probe, which
--   webhook_deliveries_order (the same columns, every status) answers as well: a job has a
--   few versions per target, read with their status from the heap;
-- * a lease changes no indexed column, but was HOT only when the row's page had room left
--   for the new version (64 % of leases in that run): pages are filled to three quarters,
--   so the lease, and the next ones' on the same page, find room.
-- (One index on id is built in place of the two, under the table's lock: a unique
-- constraint's index cannot become the primary key's.)
ALTER TABLE webhook_deliveries DROP CONSTRAINT webhook_deliveries_pkey, DROP CONSTRAINT webhook_deliveries_id_key,
    ADD CONSTRAINT webhook_deliveries_pkey PRIMARY KEY (id);
DROP INDEX webhook_deliveries_pending_order;
ALTER TABLE webhook_deliveries SET (fillfactor = 75);
