-- idem: least-privilege roles for SQL Server 2019+ (written from the documentation; not
-- verified live here). Not a migration: run it with sqlcmd (batches end with GO) as the
-- owner (db_owner) of idem's tables, in their database and default schema, AFTER the
-- migrations (0001 to 0005). It is idempotent.
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
-- Database roles: add your application's database users to them
-- (ALTER ROLE idem_writer ADD MEMBER app_user;).
--
-- A column grant cannot say "only while response IS NULL": the writer needs UPDATE on
-- response to complete its own placeholder. So a trigger refuses any UPDATE of a
-- completed record (response IS NOT NULL) that has not expired (expires_at in the
-- future, SYSUTCDATETIME()), whoever runs it: idem itself never rewrites a live
-- completed record; it only takes over expired ones. SQL Server has no BEFORE
-- triggers: this AFTER trigger raises error 50001, which rolls the whole transaction
-- back (XACT_ABORT is on inside triggers); idem reports it and never retries it.
IF DATABASE_PRINCIPAL_ID(N'idem_writer') IS NULL CREATE ROLE idem_writer;
IF DATABASE_PRINCIPAL_ID(N'idem_purger') IS NULL CREATE ROLE idem_purger;
GO

GRANT SELECT, INSERT ON idem_request_result TO idem_writer;
GRANT SELECT, INSERT ON idem_processed_message TO idem_writer;
GRANT UPDATE (request, response, status, created_at, expires_at) ON idem_request_result TO idem_writer;
GRANT UPDATE (fingerprint, processed_at, expires_at) ON idem_processed_message TO idem_writer;

GRANT SELECT, DELETE ON idem_request_result TO idem_purger;
GRANT SELECT, DELETE ON idem_processed_message TO idem_purger;
GO

GRANT SELECT, INSERT, UPDATE, DELETE ON idem_run TO idem_writer;
GRANT SELECT, INSERT, UPDATE ON idem_outbox TO idem_writer;
GRANT SELECT, DELETE ON idem_run TO idem_purger;
GRANT SELECT, DELETE ON idem_outbox TO idem_purger;
GO

CREATE OR ALTER TRIGGER idem_request_result_guard ON idem_request_result AFTER UPDATE
AS
BEGIN
    SET NOCOUNT ON;
    IF EXISTS (SELECT 1 FROM deleted WHERE response IS NOT NULL AND expires_at > SYSUTCDATETIME())
        THROW 50001, N'idem: a completed record is live until it expires: its request and response cannot change', 1;
END;
GO
