-- PostgreSQL migration 12: the claim passes over a tenant at its cap before reading.

-- Migration 10's claim read every pending target's candidates, then dropped those of tenants
-- with no slot left here (p_per_tenant). A tenant at its cap behind many targets (the noisy
-- bench: 40 hanging callback receivers) was read in full on every claim for nothing, and its
-- older deliveries to a target another tenant shares took that target's room. Now the claim
-- walks tenants first (a loose scan of the index below: one probe per tenant), leaves out
-- those at their cap, then each remaining tenant's targets and their candidates (at most the
-- target's room each; a target several tenants share keeps its room for the oldest over
-- them). The same rules as SQLite's claim (herald/storage/sqlite/queue.py), same signature.
CREATE INDEX webhook_deliveries_pending_by_tenant ON webhook_deliveries (tenant, target, next_attempt_at, seq)
    WHERE status = 'pending';

-- herald_webhook_claim: its definition is functions/webhooks_claim.sql now (repeatable: applied whenever it changes).
