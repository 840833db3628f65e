-- PostgreSQL migration 5 (SPEC §13). A capped claim (Change.max_running) locks the job row,
-- then the tenant's counter row (the order every write takes them in), counts the tenant's
-- running jobs and only then transitions: two capped claims of one tenant are serialised,
-- so both cannot take its last slot. -1: the tenant is at its cap. Claims without a cap
-- never come here.

CREATE INDEX IF NOT EXISTS jobs_running_by_tenant ON jobs (tenant) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS jobs_queued_by_tenant ON jobs (kind, tenant, created_at) WHERE state = 'queued';

CREATE OR REPLACE FUNCTION herald_claim_capped(
    p_max_running INTEGER,
    p_id TEXT, p_seen_version INTEGER, p_seen_updated_at DOUBLE PRECISION,
    p_state TEXT, p_progress INTEGER, p_attempt INTEGER, p_cancel_requested BOOLEAN,
    p_heartbeat_at DOUBLE PRECISION, p_error BYTEA, p_result_path TEXT, p_media_type TEXT,
    p_finished_at DOUBLE PRECISION, p_expires_at DOUBLE PRECISION, p_updated_at DOUBLE PRECISION,
    p_event_type TEXT, p_event_subject TEXT, p_event_data BYTEA, p_event_tail BYTEA,
    p_work_subject TEXT, p_work_msg_id TEXT, p_work_payload BYTEA
) RETURNS BIGINT LANGUAGE plpgsql AS $fn$
DECLARE
    v_tenant TEXT;
    v_running BIGINT;
BEGIN
    SELECT j.tenant INTO v_tenant FROM jobs j WHERE j.id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM tenant_seq s WHERE s.tenant = v_tenant FOR UPDATE;
    -- A new snapshot: every claim that held the lock before us has committed and is counted.
    SELECT count(*) INTO v_running FROM jobs j WHERE j.tenant = v_tenant AND j.state = 'running';
    IF v_running >= p_max_running THEN
        RETURN -1;
    END IF;
    RETURN herald_transition(p_id, p_seen_version, p_seen_updated_at, p_state, p_progress, p_attempt,
                             p_cancel_requested, p_heartbeat_at, p_error, p_result_path, p_media_type,
                             p_finished_at, p_expires_at, p_updated_at, p_event_type, p_event_subject,
                             p_event_data, p_event_tail, p_work_subject, p_work_msg_id, p_work_payload);
END
$fn$;
