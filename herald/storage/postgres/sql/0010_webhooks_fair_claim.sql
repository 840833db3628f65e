-- PostgreSQL migration 10: the claim, fair among tenants, and within a tenant among its
-- targets (SPEC §13). "Migration 3" in the comments is migration 9 (0009), from when each
-- store numbered its own migrations.
--
-- The candidates are read as in migration 3 (per target, at most the slots the target has
-- left in this notifier), minus the targets the notifier holds back (p_held: at
-- their cap per origin, or paced by its circuit breaker). Then, instead of "oldest first
-- over everything" (which let a tenant's backlog take every slot before another tenant's
-- due delivery), each tenant's candidates are ranked round robin over its targets and cut
-- at the slots the tenant has left here (p_per_tenant minus p_busy_tenants' counts), and
-- the free slots go to the tenant with the fewest in flight first (water-filling: slot k
-- of a tenant with n in flight sorts at n + k), oldest first among equals.

-- The claim of the six parameters a database made before the fair claim has (migration 7 made
-- it, migration 9 replaced it: both have since given it up).
DROP FUNCTION IF EXISTS herald_webhook_claim(TEXT, DOUBLE PRECISION, INTEGER, INTEGER, TEXT[], INTEGER[]);

-- herald_webhook_claim: its definition is functions/webhooks_claim.sql now (repeatable: applied whenever it changes).
