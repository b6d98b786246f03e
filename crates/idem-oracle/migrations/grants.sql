-- idem: least-privilege roles for Oracle Database 19c+ (written from the documentation;
-- not verified live here). Not a migration: run it with SQL*Plus or SQLcl (PL/SQL
-- blocks end with '/') as the schema that owns idem's tables, AFTER the migrations
-- (0001 to 0005). CREATE ROLE needs the CREATE ROLE privilege; a re-run reports ORA-01921
-- (role exists) for the first two statements and is otherwise idempotent.
--
--   idem_writer  what Idem::execute / execute_final / consume need: read records, claim
--                (INSERT), complete a placeholder and take over an EXPIRED record
--                (UPDATE of request, response, status, created_at, expires_at only).
--                No DELETE of records, no UPDATE of their key columns.
--                Phased runs and the outbox (Idem::start, Run, Idem::relay): read,
--                insert, update and delete runs (a run's row is rewritten by every
--                phase, and an expired one is deleted and started again); read, insert
--                and update outbox messages (enqueue, the relay's claims and outcomes,
--                Idem::outbox_retry / `idem outbox retry`).
--   idem_purger  what `idem purge` / Idem::purge need: read and delete records, runs
--                and sent outbox messages; also what `idem outbox drop` /
--                Idem::outbox_drop needs (DELETE of unsent outbox messages).
--
-- Grant a role to the application's user (GRANT idem_writer TO app_user;). The tables
-- stay in the owner's schema: the application connects with
-- ALTER SESSION SET CURRENT_SCHEMA = <owner> (or uses synonyms).
--
-- A column grant cannot say "only while response IS NULL": the writer needs UPDATE on
-- response to complete its own placeholder. So a trigger refuses any UPDATE of a
-- completed record (response IS NOT NULL) that has not expired (expires_at in the
-- future, UTC database clock), whoever runs it: idem itself never rewrites a live
-- completed record; it only takes over expired ones. The error is ORA-20001, which idem
-- reports and never retries.
CREATE ROLE idem_writer;
CREATE ROLE idem_purger;

GRANT SELECT, INSERT ON idem_request_result TO idem_writer;
GRANT SELECT, INSERT ON idem_processed_message TO idem_writer;
GRANT UPDATE (request, response, status, created_at, expires_at) ON idem_request_result TO idem_writer;
GRANT UPDATE (fingerprint, processed_at, expires_at) ON idem_processed_message TO idem_writer;

GRANT SELECT, DELETE ON idem_request_result TO idem_purger;
GRANT SELECT, DELETE ON idem_processed_message TO idem_purger;

GRANT SELECT, INSERT, UPDATE, DELETE ON idem_run TO idem_writer;
GRANT SELECT, INSERT, UPDATE ON idem_outbox TO idem_writer;
GRANT SELECT, DELETE ON idem_run TO idem_purger;
GRANT SELECT, DELETE ON idem_outbox TO idem_purger;

CREATE OR REPLACE TRIGGER idem_request_result_guard
BEFORE UPDATE ON idem_request_result
FOR EACH ROW
BEGIN
    IF :OLD.response IS NOT NULL AND :OLD.expires_at > SYS_EXTRACT_UTC(SYSTIMESTAMP) THEN
        RAISE_APPLICATION_ERROR(-20001, 'idem: a completed record is live until it expires: its request and response cannot change');
    END IF;
END;
/
