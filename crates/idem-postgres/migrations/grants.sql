-- idem: least-privilege roles for PostgreSQL 15+. Not a migration: run it as the owner
-- of idem's tables, in their schema (search_path), AFTER the migrations (0001 to 0005),
-- and again after any later migration. It is idempotent.
--
--   idem_writer  what Idem::execute / execute_final / consume need: read records, claim
--                (INSERT), complete a placeholder and take over an EXPIRED record
--                (UPDATE of request, response, status, created_at, expires_at only).
--                No DELETE, no TRUNCATE, no UPDATE of the key columns.
--                Phased runs (Idem::start, Run, Idem::complete): read, insert, the
--                guarded write (UPDATE of the non-key columns only) and the DELETE of an
--                expired run being replaced. The outbox (enqueue, Idem::relay,
--                Idem::outbox_retry / `idem outbox retry`): read, insert, and the relay's
--                bookkeeping (UPDATE of sent_at and the retry columns of 0004 only).
--   idem_purger  what `idem purge` / Idem::purge need: read and delete records, expired
--                runs and sent outbox messages; also what `idem outbox drop` /
--                Idem::outbox_drop needs (DELETE of unsent outbox messages).
--
-- Both are NOLOGIN group roles: grant them to your application's login roles
-- (GRANT idem_writer TO app_login;). Migrations keep running as the owner.
--
-- A column grant cannot say "only while response IS NULL": the writer needs UPDATE on
-- response to complete its own placeholder. So a trigger refuses any UPDATE of a
-- completed record (response IS NOT NULL) that has not expired (expires_at in the
-- future, by the database clock), whoever runs it, the owner included: idem itself
-- never rewrites a live completed record; it only takes over expired ones. The error is
-- SQLSTATE 42501 (insufficient_privilege), which idem reports and never retries.
DO $$
BEGIN
    CREATE ROLE idem_writer NOLOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
DO $$
BEGIN
    CREATE ROLE idem_purger NOLOGIN;
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
DO $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO idem_writer, idem_purger', current_schema());
END $$;

GRANT SELECT, INSERT ON idem_request_result, idem_processed_message TO idem_writer;
GRANT UPDATE (request, response, status, created_at, expires_at) ON idem_request_result TO idem_writer;
GRANT UPDATE (fingerprint, processed_at, expires_at) ON idem_processed_message TO idem_writer;

-- The purge's DELETE … WHERE key IN (SELECT … FOR UPDATE SKIP LOCKED) needs SELECT
-- and DELETE, and FOR UPDATE needs UPDATE on at least one column: expires_at, which
-- the trigger below still guards on live completed records.
GRANT SELECT, DELETE ON idem_request_result, idem_processed_message TO idem_purger;
GRANT UPDATE (expires_at) ON idem_request_result, idem_processed_message TO idem_purger;

-- Phased runs and the outbox (0003). The relay's FOR UPDATE SKIP LOCKED needs the
-- writer's UPDATE of sent_at. The purger's FOR UPDATE needs UPDATE of one column: the
-- bookkeeping columns updated_at and created_at, which no protocol decision reads.
GRANT SELECT, INSERT, DELETE ON idem_run TO idem_writer;
GRANT UPDATE (owner, fence, point, state, status, response, lease_until, updated_at) ON idem_run TO idem_writer;
GRANT SELECT, INSERT ON idem_outbox TO idem_writer;
GRANT UPDATE (sent_at, attempts, next_attempt_at, claim_token, claimed_until, last_error, dead_at) ON idem_outbox TO idem_writer;
GRANT SELECT, DELETE ON idem_run, idem_outbox TO idem_purger;
GRANT UPDATE (updated_at) ON idem_run TO idem_purger;
GRANT UPDATE (created_at) ON idem_outbox TO idem_purger;

CREATE OR REPLACE FUNCTION idem_request_result_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.response IS NOT NULL AND OLD.expires_at > clock_timestamp() THEN
        RAISE EXCEPTION 'idem: record (%, %, %) is completed and live until %: its request and response cannot change',
            OLD.principal, OLD.operation, OLD.request_key, OLD.expires_at
            USING ERRCODE = '42501';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS idem_request_result_guard ON idem_request_result;
CREATE TRIGGER idem_request_result_guard BEFORE UPDATE ON idem_request_result
    FOR EACH ROW EXECUTE FUNCTION idem_request_result_guard();
