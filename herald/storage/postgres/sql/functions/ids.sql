-- PostgreSQL function: the id of a new webhook delivery, a UUIDv7 as herald/ids.py makes it in
-- Python (why time-ordered ids: its docstring). A repeatable definition
-- (herald/storage/migrations.py): applied, after the numbered migrations, to every database
-- whose record of this file differs; edit it in place.
--
-- gen_random_uuid() (v4: 122 random bits) with its first 48 bits replaced by the Unix time in
-- milliseconds and its version nibble turned from 4 (0100) into 7 (0111): 74 random bits left,
-- as in Python. Not PostgreSQL 18's uuidv7(): it spends 12 of the random bits on a finer
-- timestamp, and a deployment's own PostgreSQL may be older.
CREATE OR REPLACE FUNCTION herald_uuid7() RETURNS TEXT LANGUAGE sql VOLATILE PARALLEL SAFE AS $fn$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::UUID::TEXT
$fn$;
