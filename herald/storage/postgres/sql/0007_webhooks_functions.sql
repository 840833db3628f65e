-- PostgreSQL migration 7: the webhook functions (keys, fan-out, finish; the claim is
-- migration 10's).
-- The names in braces are filled in when it is applied (herald/storage/postgres/schema.py).

-- A new current key; the previous current one signs for the overlap, then retires.
CREATE FUNCTION herald_webhook_add_key(
    p_owner TEXT, p_algorithm TEXT, p_secret BYTEA, p_public_key BYTEA, p_overlap DOUBLE PRECISION
) RETURNS VOID LANGUAGE plpgsql AS $$
DECLARE
    ts DOUBLE PRECISION;
    latest DOUBLE PRECISION;
BEGIN
    PERFORM pg_advisory_xact_lock({key_lock}, hashtext(p_owner));
    ts := {now};
    DELETE FROM webhook_keys k WHERE k.owner = p_owner AND k.retire_at IS NOT NULL AND k.retire_at <= ts;
    UPDATE webhook_keys k SET retire_at = ts + p_overlap WHERE k.owner = p_owner AND k.retire_at IS NULL;
    SELECT max(k.created_at) INTO latest FROM webhook_keys k WHERE k.owner = p_owner;
    INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)
    -- the key's primary key must move forward
    VALUES (p_owner, greatest(ts, coalesce(latest + 1e-6, ts)), p_algorithm, p_secret, p_public_key);
END $$;

-- The owner's current key; the given one becomes it if there is none (first use).
CREATE FUNCTION herald_webhook_ensure_key(
    p_owner TEXT, p_algorithm TEXT, p_secret BYTEA, p_public_key BYTEA
) RETURNS TABLE (algorithm TEXT, secret BYTEA, public_key BYTEA) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock({key_lock}, hashtext(p_owner));
    RETURN QUERY SELECT k.algorithm, k.secret, k.public_key FROM webhook_keys k
        WHERE k.owner = p_owner AND k.retire_at IS NULL;
    IF FOUND THEN
        RETURN;
    END IF;
    INSERT INTO webhook_keys (owner, created_at, algorithm, secret, public_key)
    VALUES (p_owner, {now}, p_algorithm, p_secret, p_public_key);
    RETURN QUERY SELECT p_algorithm, p_secret, p_public_key;
END $$;

-- SQLite's fan_out and _add_delivery (herald/storage/sqlite/queue.py), statement for statement,
-- after the locks.
CREATE FUNCTION herald_webhook_fan_out(
    p_tenants TEXT[], p_job_ids TEXT[], p_versions INTEGER[], p_types TEXT[], p_kinds TEXT[],
    p_event_ids TEXT[], p_bodies BYTEA[], p_progress_interval DOUBLE PRECISION
) RETURNS INTEGER LANGUAGE plpgsql SET enable_seqscan = off AS $$
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
    pending INTEGER := 0;
BEGIN
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
    IF cardinality(t_ords) = 0 THEN
        RETURN 0;
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
        VALUES (gen_random_uuid()::TEXT, p_tenants[o], tgt, t_endpoints[i], t_urls[i], eid, job, ver, typ,
                new_status, due, CASE WHEN new_status = 'pending' THEN due END, ts, ts)
        ON CONFLICT (event_id, target) DO NOTHING;
        IF FOUND AND new_status = 'pending' THEN
            pending := pending + 1;
        END IF;
    END LOOP;
    RETURN pending;
END $$;

-- SQLite's finish, _status_after and _endpoint_health (herald/storage/sqlite/queue.py) in one
-- transaction.
CREATE FUNCTION herald_webhook_finish(
    p_id TEXT, p_target TEXT, p_job_id TEXT, p_owner TEXT, p_started_at DOUBLE PRECISION,
    p_status_code INTEGER, p_latency_ms DOUBLE PRECISION, p_error TEXT, p_response BYTEA, p_ok BOOLEAN,
    p_plan TEXT, p_delay_s DOUBLE PRECISION, p_gone BOOLEAN, p_disable_after DOUBLE PRECISION,
    OUT o_status TEXT, OUT o_next_attempt_at DOUBLE PRECISION, OUT o_endpoint_disabled BOOLEAN
) LANGUAGE plpgsql SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    ts DOUBLE PRECISION;
    d webhook_deliveries;
    n INTEGER;
    e_status TEXT;
    e_failing DOUBLE PRECISION;
BEGIN
    -- In turn with fan-outs of this job and target (the "newer version" check below) and
    -- with another finish of the same delivery (attempt numbers).
    PERFORM pg_advisory_xact_lock({order_lock}, hashtext(p_target || chr(10) || p_job_id));
    ts := {now};
    o_endpoint_disabled := FALSE;
    SELECT * INTO d FROM webhook_deliveries WHERE id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        o_status := 'dropped';  -- its endpoint was deleted meanwhile
        RETURN;
    END IF;
    SELECT coalesce(max(a.n), 0) + 1 INTO n FROM webhook_attempts a WHERE a.delivery_id = p_id;
    INSERT INTO webhook_attempts (delivery_id, n, at, status_code, latency_ms, error, response)
    VALUES (p_id, n, p_started_at, p_status_code, p_latency_ms, p_error, p_response);

    IF p_plan = 'delivered' OR p_plan = 'failed' THEN
        o_status := p_plan;
    ELSIF EXISTS (SELECT 1 FROM webhook_deliveries x
                   WHERE x.target = d.target AND x.job_id = d.job_id AND x.version > d.version) THEN
        o_status := 'superseded';  -- the newer one carries the whole status: no need to retry this one
    ELSE
        o_status := 'pending';
        o_next_attempt_at := ts + p_delay_s;
    END IF;

    -- Endpoint health: continuous failure is tracked; 410 or 5 days of it disables.
    IF d.endpoint_id IS NOT NULL THEN
        IF p_ok THEN
            UPDATE webhook_endpoints SET failing_since = NULL WHERE id = d.endpoint_id AND failing_since IS NOT NULL;
        ELSE
            UPDATE webhook_endpoints SET failing_since = coalesce(failing_since, ts) WHERE id = d.endpoint_id
            RETURNING status, failing_since INTO e_status, e_failing;
            IF FOUND AND e_status <> 'enabled' THEN
                o_endpoint_disabled := TRUE;
            ELSIF FOUND AND (p_gone OR ts - e_failing >= p_disable_after) THEN
                -- As the API's disable does: FOR UPDATE waits for fan-outs holding the endpoint
                -- (FOR KEY SHARE), so the failing below, a new snapshot, sees what they queued.
                PERFORM 1 FROM webhook_endpoints WHERE id = d.endpoint_id FOR UPDATE;
                UPDATE webhook_endpoints SET status = 'disabled', updated_at = ts WHERE id = d.endpoint_id;
                -- its waiting deliveries end failed; this one is settled just below, with its attempt count
                UPDATE webhook_deliveries SET status = 'failed', next_attempt_at = NULL, lease_owner = NULL,
                       lease_until = NULL, updated_at = ts
                 WHERE endpoint_id = d.endpoint_id AND status = 'pending' AND id <> p_id;
                o_endpoint_disabled := TRUE;
            END IF;
        END IF;
        IF o_endpoint_disabled AND o_status = 'pending' THEN
            o_status := 'failed';
            o_next_attempt_at := NULL;
        END IF;
    END IF;

    UPDATE webhook_deliveries SET status = o_status, attempts = n, next_attempt_at = o_next_attempt_at,
           lease_owner = NULL, lease_until = NULL, updated_at = ts
     WHERE id = p_id AND lease_owner = p_owner;
END $$;
