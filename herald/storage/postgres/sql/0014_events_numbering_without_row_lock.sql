-- PostgreSQL migration 14: a numbering pass with nothing left to number writes nothing.
--
-- Migration 13's pass locked the tenant's tenant_seq row (SELECT ... FOR UPDATE). A row lock
-- is a write: the pass got a transaction id and its commit waited for a WAL flush even when
-- the pass before it (another process's relay, which it had waited for) had numbered every
-- row it came for, which under load was most passes. Passes of a tenant now take turns on a
-- transaction-scoped advisory lock instead (memory only, no WAL), keyed by a 64-bit hash of
-- the tenant so that two tenants practically never share one, and write only when they
-- number something. The lock is released after the commit is visible, as a row lock is, so
-- a pass still reads every number the previous one gave. A pass takes its tenants in byte
-- order (herald_outbox_batch), so two passes cannot wait on each other in a cycle; a capped
-- claim (SPEC §13) still locks the tenant_seq row, which a pass updates last.

CREATE OR REPLACE FUNCTION herald_number_events(p_tenant TEXT) RETURNS INTEGER LANGUAGE plpgsql AS $fn$
DECLARE
    v_last BIGINT;
    v_count INTEGER;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_tenant, {number_lock}));
    -- A statement of its own, so a snapshot taken after the lock: every event committed
    -- before now, and every number the previous pass gave, are seen.
    SELECT s.last INTO v_last FROM tenant_seq s WHERE s.tenant = p_tenant;
    WITH todo AS (
        SELECT e.id, row_number() OVER (ORDER BY e.id) AS n
        FROM events e WHERE e.tenant = p_tenant AND e.seq IS NULL
    ), numbered AS (
        UPDATE events e SET seq = coalesce(v_last, 0) + todo.n FROM todo WHERE e.id = todo.id RETURNING 1
    )
    SELECT count(*) INTO v_count FROM todo;  -- the UPDATE runs whether or not it is read
    IF v_count > 0 THEN
        -- A row retention deleted meanwhile leaves its number unused, as retention does anyway.
        INSERT INTO tenant_seq AS s (tenant, last) VALUES (p_tenant, v_count)
        ON CONFLICT (tenant) DO UPDATE SET last = s.last + v_count;
    END IF;
    RETURN v_count;
END
$fn$;
