"""The loose scan over queued jobs that both stores' queue ages start from.

``jobs_live_by_tenant`` (state, tenant, kind, created_at) holds every live job (SQLite
migration 5, PostgreSQL 16). A GROUP BY over it would read every queued row; this recursive
CTE probes it instead: one probe per tenant with queued jobs and one per (tenant, kind),
each the first entry of its range, however long the queue. Plain SQL both backends run as
written; each appends the SELECT it needs over ``q(tenant, kind)``.
"""

QUEUED_TENANT_KINDS = """
WITH RECURSIVE
  t(tenant) AS (
    SELECT MIN(tenant) FROM jobs WHERE state = 'queued'
    UNION ALL
    SELECT (SELECT MIN(j.tenant) FROM jobs j WHERE j.state = 'queued' AND j.tenant > t.tenant)
      FROM t WHERE t.tenant IS NOT NULL),
  q(tenant, kind) AS (
    SELECT t.tenant, (SELECT MIN(j.kind) FROM jobs j WHERE j.state = 'queued' AND j.tenant = t.tenant)
      FROM t WHERE t.tenant IS NOT NULL
    UNION ALL
    SELECT q.tenant,
           (SELECT MIN(j.kind) FROM jobs j WHERE j.state = 'queued' AND j.tenant = q.tenant AND j.kind > q.kind)
      FROM q WHERE q.kind IS NOT NULL)"""

# The oldest queued job of one (tenant, kind) of ``q``: the first entry of its range.
OLDEST_OF_TENANT_KIND = (
    "(SELECT MIN(j.created_at) FROM jobs j WHERE j.state = 'queued' AND j.tenant = q.tenant AND j.kind = q.kind)"
)
