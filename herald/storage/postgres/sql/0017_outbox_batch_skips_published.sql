-- PostgreSQL migration 17: herald_outbox_batch takes the rows to skip (issue 24, fewer
-- statements per job). A relay's published rows are deleted in front of its process's next
-- grouped statement (PgDatabase.write_soon), not by a statement of their own, so until then
-- its batch must not hand them out again. The function (sql/functions/events_numbering.sql)
-- gained a parameter; CREATE OR REPLACE cannot change a function's arguments, so the old
-- one goes here. (A process of a Herald from before this change calls the old one: upgrade
-- every process together, as for migration 10.)
DROP FUNCTION IF EXISTS herald_outbox_batch(TEXT, DOUBLE PRECISION, INTEGER);
