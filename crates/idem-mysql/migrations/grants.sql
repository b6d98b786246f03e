-- idem: least-privilege roles for MariaDB 10.11+ and MySQL 8.4. Not a migration: run
-- it with the mysql client (it uses DELIMITER) as an administrator, with idem's
-- database selected (mysql … app_db < grants.sql), AFTER the migrations (0001 to 0005).
-- It is idempotent.
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
-- Give a role to the application's account and make it active at login:
--   GRANT idem_writer TO 'app'@'%';
--   MariaDB:   SET DEFAULT ROLE idem_writer FOR 'app'@'%';
--   MySQL 8.4: SET DEFAULT ROLE idem_writer TO 'app'@'%';
--
-- A column grant cannot say "only while response IS NULL": the writer needs UPDATE on
-- response to complete its own placeholder. So a trigger refuses any UPDATE of a
-- completed record (response IS NOT NULL) that has not expired (expires_at in the
-- future, UTC database clock), whoever runs it: idem itself never rewrites a live
-- completed record; it only takes over expired ones. The error is SQLSTATE 45000
-- (MySQL error 1644), which idem reports and never retries.
CREATE ROLE IF NOT EXISTS idem_writer;
CREATE ROLE IF NOT EXISTS idem_purger;

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

DROP TRIGGER IF EXISTS idem_request_result_guard;
DELIMITER //
CREATE TRIGGER idem_request_result_guard BEFORE UPDATE ON idem_request_result
FOR EACH ROW
BEGIN
    IF OLD.response IS NOT NULL AND OLD.expires_at > UTC_TIMESTAMP(6) THEN
        SIGNAL SQLSTATE '45000'
            SET MESSAGE_TEXT = 'idem: a completed record is live until it expires: its request and response cannot change';
    END IF;
END//
DELIMITER ;
