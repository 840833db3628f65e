-- PostgreSQL functions, a job event's webhook deliveries.
-- A repeatable definition (herald/storage/migrations.py): applied, after the numbered
-- migrations, to every database whose record of this file differs; edit it in place.
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).

-- herald.delivery_rules.place for each event and target, next to the data, after the locks
-- (SQLite's _add_delivery calls the rulebook itself). Its numbers come in as arguments
-- (p_progress_interval: PROGRESS_INTERVAL_S), and tests/store_contract/test_rulebook.py
-- holds its decisions to the rulebook's, case by case. Besides how many deliveries are
-- pending, it says which targets got one (touched_tenants and touched_targets, pairwise): the
-- leasing fan-out claims among those alone.
--
-- Each tenant's events are placed up to its share, and all of them up to p_batch
-- (herald.delivery_rules.share_fan_out, in herald_webhook_share_fan_out), counted on the
-- receivers found here. A batch from the stream
-- (p_draining false) puts the rest, and every event of a tenant that has some waiting already,
-- to wait in webhook_fan_out_waiting, behind that tenant's earlier ones. A tenant's events must
-- not pass its waiting ones: a batch that puts a tenant's first events to wait holds the
-- tenant's share lock exclusively until it commits, and every other batch takes it shared
-- before it looks for waiting events (so batches that put nothing to wait never wait for each
-- other). A drain (p_draining: one tenant's oldest waiting events, under its drain lock) places
-- the first of them up to the share and leaves the rest where they are. placed: how many of the
-- events given were placed (the first ones of each tenant).
CREATE OR REPLACE FUNCTION herald_webhook_fan_out_touching(
    p_tenants TEXT[], p_job_ids TEXT[], p_versions INTEGER[], p_types TEXT[], p_kinds TEXT[],
    p_event_ids TEXT[], p_bodies BYTEA[], p_progress_interval DOUBLE PRECISION, p_share INTEGER,
    p_batch INTEGER, p_draining BOOLEAN,
    OUT pending INTEGER, OUT placed INTEGER, OUT touched_tenants TEXT[], OUT touched_targets TEXT[]
) LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION;
    t_ords INTEGER[];
    t_targets TEXT[];
    t_endpoints TEXT[];
    t_urls TEXT[];
    done TEXT[];
    lock_key INTEGER;
    i INTEGER;
    o INTEGER;
    tgt TEXT;
    eid TEXT;
    job TEXT;
    ver INTEGER;
    typ TEXT;
    newer_sent BOOLEAN;
    last_progress DOUBLE PRECISION;
    new_status TEXT;
    due DOUBLE PRECISION;
    costs INTEGER[];
    goes BOOLEAN[];
    over TEXT[];
    waits TEXT[];
    who TEXT;
BEGIN
    pending := 0;
    placed := coalesce(cardinality(p_tenants), 0);
    touched_tenants := '{}';
    touched_targets := '{}';
    -- Endpoints that take part are held against deletion and API disabling until commit
    -- (those take the row FOR UPDATE first); routine updates do not wait for this lock.
    PERFORM 1 FROM webhook_endpoints e
        WHERE e.tenant = ANY(p_tenants) AND e.status = 'enabled' ORDER BY e.id FOR KEY SHARE;

    -- Every receiver of every event: matching enabled endpoints, then the job's callback
    -- URL (read from the job's row, never copied into the event stream).
    SELECT coalesce(array_agg(r.ord ORDER BY r.ord, r.cb, r.target), '{}'),
           coalesce(array_agg(r.target ORDER BY r.ord, r.cb, r.target), '{}'),
           coalesce(array_agg(r.endpoint_id ORDER BY r.ord, r.cb, r.target), '{}'),
           coalesce(array_agg(r.url ORDER BY r.ord, r.cb, r.target), '{}')
      INTO t_ords, t_targets, t_endpoints, t_urls
      FROM (
        SELECT ev.ord::INTEGER AS ord, e.id AS target, e.id AS endpoint_id, NULL::TEXT AS url, 0 AS cb
          FROM unnest(p_tenants, p_types, p_kinds) WITH ORDINALITY AS ev(tenant, type, kind, ord)
          JOIN webhook_endpoints e
            ON e.tenant = ev.tenant AND e.status = 'enabled' AND ev.type = ANY(e.event_types)
           AND (e.kinds IS NULL OR ev.kind = ANY(e.kinds))
        UNION ALL
        SELECT ev.ord::INTEGER, '{callback_prefix}' || j.callback_url, NULL, j.callback_url, 1
          FROM unnest(p_job_ids, p_types) WITH ORDINALITY AS ev(job_id, type, ord)
          JOIN jobs j ON j.id = ev.job_id
         WHERE ev.type <> 'job.progress' AND j.callback_url IS NOT NULL AND j.callback_url <> ''
      ) r;

    -- The share. At most a share of receivers in all: no tenant is over it, and only a tenant
    -- with events waiting already holds anything back.
    IF cardinality(t_ords) > p_share OR NOT p_draining THEN
        costs := array_fill(0, ARRAY[placed]);
        FOREACH o IN ARRAY t_ords LOOP
            costs[o] := costs[o] + 1;
        END LOOP;
        goes := CASE WHEN cardinality(t_ords) > p_share
                     THEN herald_webhook_share_fan_out(p_tenants, costs, '{}', p_share, p_batch)
                     ELSE array_fill(TRUE, ARRAY[placed]) END;
        IF NOT p_draining THEN
            SELECT coalesce(array_agg(DISTINCT p_tenants[k]), '{}') INTO over
              FROM generate_subscripts(p_tenants, 1) AS k WHERE NOT goes[k];
            FOR who IN SELECT DISTINCT t FROM unnest(p_tenants) AS t ORDER BY 1 LOOP
                IF who = ANY(over) THEN
                    PERFORM pg_advisory_xact_lock({share_lock}, hashtext(who));
                ELSE
                    PERFORM pg_advisory_xact_lock_shared({share_lock}, hashtext(who));
                END IF;
            END LOOP;
            SELECT coalesce(array_agg(x.t), '{}') INTO waits
              FROM (SELECT DISTINCT t FROM unnest(p_tenants) AS t) x
             WHERE EXISTS (SELECT 1 FROM webhook_fan_out_waiting w WHERE w.tenant = x.t);
            IF cardinality(waits) > 0 THEN
                goes := herald_webhook_share_fan_out(p_tenants, costs, waits, p_share, p_batch);
            END IF;
            INSERT INTO webhook_fan_out_waiting (tenant, job_id, version, type, kind, event_id, body, created_at)
            SELECT p_tenants[k], p_job_ids[k], p_versions[k], p_types[k], p_kinds[k], p_event_ids[k], p_bodies[k],
                   {now}
              FROM generate_subscripts(p_tenants, 1) AS k WHERE NOT goes[k] ORDER BY k;
        END IF;
        IF FALSE = ANY(goes) THEN
            placed := 0;
            FOR k IN 1 .. cardinality(goes) LOOP
                placed := placed + goes[k]::INTEGER;
            END LOOP;
            SELECT coalesce(array_agg(x.o ORDER BY x.n), '{}'), coalesce(array_agg(x.tg ORDER BY x.n), '{}'),
                   coalesce(array_agg(x.ep ORDER BY x.n), '{}'), coalesce(array_agg(x.u ORDER BY x.n), '{}')
              INTO t_ords, t_targets, t_endpoints, t_urls
              FROM unnest(t_ords, t_targets, t_endpoints, t_urls) WITH ORDINALITY AS x(o, tg, ep, u, n)
             WHERE goes[x.o];
        END IF;
    END IF;
    IF cardinality(t_ords) = 0 THEN
        RETURN;
    END IF;

    -- One job's deliveries to one target are decided by one fan-out (or finish) at a time.
    -- Sorted, so that two fan-outs sharing keys cannot deadlock.
    FOR lock_key IN
        SELECT DISTINCT hashtext(x.target || chr(10) || p_job_ids[x.ord])
          FROM unnest(t_targets, t_ords) AS x(target, ord) ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock({order_lock}, lock_key);
    END LOOP;
    ts := {now};

    -- The body once per event. A redelivered old event refreshes created_at, so pruning
    -- (which re-checks it under the row lock) cannot drop a body it is about to need.
    INSERT INTO webhook_messages (event_id, body, created_at)
    SELECT DISTINCT ON (p_event_ids[x.ord]) p_event_ids[x.ord], p_bodies[x.ord], ts
      FROM unnest(t_ords) AS x(ord) ORDER BY p_event_ids[x.ord]
    ON CONFLICT (event_id) DO UPDATE SET created_at = EXCLUDED.created_at;

    -- What was fanned out before (a redelivery), read once for the batch, after the locks.
    SELECT coalesce(array_agg(d.event_id || chr(10) || d.target), '{}') INTO done
      FROM webhook_deliveries d WHERE d.event_id = ANY(p_event_ids);

    FOR i IN 1 .. cardinality(t_ords) LOOP
        o := t_ords[i];
        tgt := t_targets[i];
        eid := p_event_ids[o];
        job := p_job_ids[o];
        ver := p_versions[o];
        typ := p_types[o];
        -- A redelivered NATS message: already fanned out.
        CONTINUE WHEN eid || chr(10) || tgt = ANY(done);
        -- A newer event of this job can reach us first. If a newer delivery was already
        -- sent or is being sent, this one would go back in time; otherwise it goes first.
        -- The newer rows are locked, so that no claim can lease one while we decide.
        SELECT coalesce(bool_or(n.attempts > 0 OR n.lease_until > ts), FALSE) INTO newer_sent
          FROM (SELECT d.attempts, d.lease_until FROM webhook_deliveries d
                 WHERE d.target = tgt AND d.job_id = job AND d.version > ver
                   FOR UPDATE) n;
        new_status := 'pending';
        due := ts;
        IF newer_sent THEN
            new_status := 'superseded';
        ELSE
            -- Older deliveries waiting for a retry (or a progress slot) say less than this one.
            UPDATE webhook_deliveries d SET status = 'superseded', next_attempt_at = NULL, updated_at = ts
             WHERE d.target = tgt AND d.job_id = job AND d.version < ver
               AND d.status = 'pending' AND (d.lease_until IS NULL OR d.lease_until <= ts)
               AND (d.attempts > 0 OR d.type = 'job.progress');
            IF typ = 'job.progress' THEN
                SELECT max(d.scheduled_at) INTO last_progress FROM webhook_deliveries d
                 WHERE d.target = tgt AND d.job_id = job AND d.type = 'job.progress'
                   AND (d.status <> 'superseded' OR d.attempts > 0);  -- sent, or to be
                IF last_progress IS NOT NULL THEN
                    due := greatest(ts, last_progress + p_progress_interval);
                END IF;
            END IF;
        END IF;
        INSERT INTO webhook_deliveries (id, tenant, target, endpoint_id, url, event_id, job_id, version, type,
                                        status, scheduled_at, next_attempt_at, created_at, updated_at)
        VALUES (herald_uuid7(), p_tenants[o], tgt, t_endpoints[i], t_urls[i], eid, job, ver, typ,
                new_status, due, CASE WHEN new_status = 'pending' THEN due END, ts, ts)
        ON CONFLICT (event_id, target) DO NOTHING;
        IF FOUND AND new_status = 'pending' THEN
            pending := pending + 1;
            touched_tenants := touched_tenants || p_tenants[o];  -- repeats and all: the claim takes each once
            touched_targets := touched_targets || tgt;
        END IF;
    END LOOP;
END $$;

-- herald.delivery_rules.share_fan_out, element for element (tests/store_contract holds the two
-- to the same answers): which events are fanned out now (TRUE) and which wait.
CREATE OR REPLACE FUNCTION herald_webhook_share_fan_out(
    p_tenants TEXT[], p_costs INTEGER[], p_waiting TEXT[], p_share INTEGER, p_batch INTEGER
) RETURNS BOOLEAN[] LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    spent JSONB := '{}';
    late TEXT[] := p_waiting;
    goes BOOLEAN[] := '{}';
    used INTEGER;
    total INTEGER := 0;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_tenants), 0) LOOP
        used := (spent ->> p_tenants[i])::INTEGER;
        IF NOT (p_tenants[i] = ANY(late)) AND (used IS NULL OR used + p_costs[i] <= p_share)
           AND (total = 0 OR total + p_costs[i] <= p_batch) THEN
            spent := spent || jsonb_build_object(p_tenants[i], coalesce(used, 0) + p_costs[i]);
            total := total + p_costs[i];
            goes := goes || TRUE;
        ELSE
            late := late || p_tenants[i];
            goes := goes || FALSE;
        END IF;
    END LOOP;
    RETURN goes;
END $$;

-- The fan-out alone (a notifier with a backlog leases nothing as it fans out).
CREATE OR REPLACE FUNCTION herald_webhook_fan_out(
    p_tenants TEXT[], p_job_ids TEXT[], p_versions INTEGER[], p_types TEXT[], p_kinds TEXT[],
    p_event_ids TEXT[], p_bodies BYTEA[], p_progress_interval DOUBLE PRECISION, p_share INTEGER,
    p_batch INTEGER, OUT pending INTEGER, OUT waiting INTEGER
) LANGUAGE sql AS $$
    SELECT f.pending, cardinality(p_tenants) - f.placed
      FROM herald_webhook_fan_out_touching(p_tenants, p_job_ids, p_versions, p_types, p_kinds, p_event_ids, p_bodies,
                                           p_progress_interval, p_share, p_batch, FALSE) f
$$;

-- The fan-out, then in the same transaction the claim (herald_webhook_claim_among, with the
-- offer's caps) among the targets this batch has pending deliveries for: what is due at once
-- is leased to this notifier without a claim of its own, as SQLite's fan_out_leasing does.
-- Only those targets, so that a batch of one tenant's events never waits on a walk of another
-- tenant's backlog (the scheduler's claim pass takes the rest). Every row carries the
-- fan-out's pending and waiting counts; with nothing leased, one row of NULLs does.
CREATE OR REPLACE FUNCTION herald_webhook_fan_out_leasing(
    p_tenants TEXT[], p_job_ids TEXT[], p_versions INTEGER[], p_types TEXT[], p_kinds TEXT[],
    p_event_ids TEXT[], p_bodies BYTEA[], p_progress_interval DOUBLE PRECISION, p_share INTEGER,
    p_batch INTEGER, p_owner TEXT, p_lease_s DOUBLE PRECISION, p_per_target INTEGER, p_limit INTEGER,
    p_busy_targets TEXT[], p_busy_counts INTEGER[],
    p_per_tenant INTEGER, p_busy_tenants TEXT[], p_tenant_counts INTEGER[], p_held TEXT[]
) RETURNS TABLE (pending INTEGER, waiting INTEGER, delivery webhook_deliveries, send_url TEXT, body BYTEA,
                 key_algorithms TEXT[], key_secrets BYTEA[], key_public_keys BYTEA[],
                 job_traceparent TEXT, job_tracestate TEXT)
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    n INTEGER;
    w INTEGER;
    only_tenants TEXT[];
    only_targets TEXT[];
BEGIN
    SELECT f.pending, cardinality(p_tenants) - f.placed, f.touched_tenants, f.touched_targets
      INTO n, w, only_tenants, only_targets
      FROM herald_webhook_fan_out_touching(p_tenants, p_job_ids, p_versions, p_types, p_kinds, p_event_ids,
                                           p_bodies, p_progress_interval, p_share, p_batch, FALSE) f;
    IF n > 0 AND p_limit > 0 THEN
        RETURN QUERY
        SELECT n, w, c.delivery, c.send_url, c.body, c.key_algorithms, c.key_secrets, c.key_public_keys,
               c.job_traceparent, c.job_tracestate
          FROM herald_webhook_claim_among(p_owner, p_lease_s, p_per_target, p_limit, p_busy_targets,
                                          p_busy_counts, p_per_tenant, p_busy_tenants, p_tenant_counts, p_held,
                                          only_tenants, only_targets) c;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT n, w, NULL::webhook_deliveries, NULL::TEXT, NULL::BYTEA, NULL::TEXT[], NULL::BYTEA[],
                        NULL::BYTEA[], NULL::TEXT, NULL::TEXT;
END $$;

-- The waiting events of up to p_tenants tenants, the next ones after p_after by id (wrapping
-- round: the waiting tenants take turns, so one that spilled once never queues behind another's
-- backlog), each tenant's oldest up to its share, placed and no longer waiting, in one
-- transaction. A tenant's are taken by one drain at a time (a try-lock: another notifier's
-- drain takes the next tenant), so they are placed in the order they came.
CREATE OR REPLACE FUNCTION herald_webhook_drain_waiting(
    p_progress_interval DOUBLE PRECISION, p_share INTEGER, p_tenants INTEGER, p_after TEXT,
    OUT events INTEGER, OUT pending INTEGER, OUT last_tenant TEXT
) LANGUAGE plpgsql AS $$
DECLARE
    who TEXT;
    taken INTEGER := 0;
    seqs BIGINT[];
    w_tenants TEXT[];
    w_jobs TEXT[];
    w_versions INTEGER[];
    w_types TEXT[];
    w_kinds TEXT[];
    w_event_ids TEXT[];
    w_bodies BYTEA[];
    n INTEGER;
    made INTEGER;
BEGIN
    events := 0;
    pending := 0;
    FOR who IN
        WITH RECURSIVE t(tenant) AS (
            SELECT (SELECT min(w.tenant) FROM webhook_fan_out_waiting w)
            UNION ALL
            SELECT (SELECT min(w.tenant) FROM webhook_fan_out_waiting w WHERE w.tenant > t.tenant)
              FROM t WHERE t.tenant IS NOT NULL
        )
        SELECT t.tenant FROM t WHERE t.tenant IS NOT NULL
         ORDER BY p_after IS NOT NULL AND t.tenant <= p_after, t.tenant
    LOOP
        EXIT WHEN taken >= p_tenants;
        CONTINUE WHEN NOT pg_try_advisory_xact_lock({drain_lock}, hashtext(who));
        SELECT array_agg(w.seq ORDER BY w.seq), array_agg(w.tenant ORDER BY w.seq), array_agg(w.job_id ORDER BY w.seq),
               array_agg(w.version ORDER BY w.seq), array_agg(w.type ORDER BY w.seq), array_agg(w.kind ORDER BY w.seq),
               array_agg(w.event_id ORDER BY w.seq), array_agg(w.body ORDER BY w.seq)
          INTO seqs, w_tenants, w_jobs, w_versions, w_types, w_kinds, w_event_ids, w_bodies
          FROM (SELECT * FROM webhook_fan_out_waiting x WHERE x.tenant = who ORDER BY x.seq LIMIT p_share) w;
        CONTINUE WHEN seqs IS NULL;  -- drained by another notifier meanwhile
        taken := taken + 1;
        last_tenant := who;
        SELECT f.pending, f.placed INTO made, n
          FROM herald_webhook_fan_out_touching(w_tenants, w_jobs, w_versions, w_types, w_kinds, w_event_ids, w_bodies,
                                               p_progress_interval, p_share, p_share, TRUE) f;
        DELETE FROM webhook_fan_out_waiting w WHERE w.seq = ANY(seqs[1:n]);
        events := events + n;
        pending := pending + coalesce(made, 0);
    END LOOP;
END $$;
