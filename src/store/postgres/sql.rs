//! The statements of the PostgreSQL store: the schema's migration, and one statement per call
//! (times are the database's clock, `clock_timestamp()`).

pub(super) const MIGRATE: &str = "
CREATE TABLE IF NOT EXISTS idemgate_meta (
  name text PRIMARY KEY,
  value text NOT NULL
);
CREATE TABLE IF NOT EXISTS idemgate_records (
  id bytea PRIMARY KEY,
  state smallint NOT NULL,         -- 0 in progress, 1 completed, 2 unknown
  fingerprint bytea NOT NULL,
  fingerprint_version integer NOT NULL,
  owner text NOT NULL,
  lease_until timestamptz NOT NULL,
  busy_until timestamptz NOT NULL,
  created timestamptz NOT NULL,
  expires timestamptz NOT NULL,
  status integer,
  headers bytea,
  body bytea
);
CREATE INDEX IF NOT EXISTS idemgate_records_expires ON idemgate_records (expires);
CREATE TABLE IF NOT EXISTS idemgate_withdrawn (
  id bytea NOT NULL,
  owner text NOT NULL,
  until timestamptz NOT NULL,
  PRIMARY KEY (id, owner)
);
-- Bodies are kept uncompressed by the server (idemgate compresses them itself when
-- compress_min_bytes says so), so that a replay reads a large one in slices without the
-- server decompressing it from the start for each (see BODY). Only rows written from now
-- on; altered once, and not again (the lock it takes is brief, but not taken for nothing).
DO $$ BEGIN
  IF (SELECT attstorage FROM pg_attribute
      WHERE attrelid = 'idemgate_records'::regclass AND attname = 'body') <> 'e' THEN
    ALTER TABLE idemgate_records ALTER COLUMN body SET STORAGE EXTERNAL;
  END IF;
END $$;
-- The namespace that wrote each record: operators' calls see their own namespace's records
-- and those written before it was kept (NULL). Additive, under the same schema_version, so
-- that an older version still opens the database (and writes NULL); added once.
DO $$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'idemgate_records'::regclass
                 AND attname = 'namespace' AND NOT attisdropped) THEN
    ALTER TABLE idemgate_records ADD COLUMN namespace text;
  END IF;
END $$;
";

/// One statement: claims the id (a fresh row, or in place of an expired one) unless this
/// owner withdrew it, and reads back what is there otherwise. The outer `SELECT` sees the
/// statement's snapshot: a row committed by a concurrent claim after it was taken makes
/// the `INSERT` find a conflict yet stays invisible to the `SELECT`; the caller then runs
/// the statement again (a second round trip only in that race).
pub(super) const CLAIM: &str = "
WITH w AS (
  SELECT EXISTS (SELECT 1 FROM idemgate_withdrawn
                 WHERE id = $1 AND owner = $4 AND until > clock_timestamp()) AS withdrawn
), ins AS (
  INSERT INTO idemgate_records AS r (id, state, fingerprint, fingerprint_version, owner,
      lease_until, busy_until, created, expires, namespace)
  SELECT $1::bytea, 0, $2::bytea, $3::integer, $4::text,
      clock_timestamp() + $5::bigint * interval '1 millisecond',
      clock_timestamp() + $6::bigint * interval '1 millisecond',
      clock_timestamp(),
      clock_timestamp() + $7::bigint * interval '1 millisecond', $9::text
  FROM w WHERE NOT w.withdrawn
  ON CONFLICT (id) DO UPDATE SET state = 0, fingerprint = excluded.fingerprint,
      fingerprint_version = excluded.fingerprint_version, owner = excluded.owner,
      lease_until = excluded.lease_until, busy_until = excluded.busy_until,
      created = excluded.created, expires = excluded.expires,
      status = NULL, headers = NULL, body = NULL, namespace = excluded.namespace
    WHERE r.expires <= clock_timestamp()
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins) AS claimed, (SELECT withdrawn FROM w) AS withdrawn,
  r.state, r.fingerprint, r.fingerprint_version,
  (extract(epoch FROM (r.lease_until - clock_timestamp())) * 1000)::bigint AS lease_left,
  r.status, r.headers, CASE WHEN length(r.body) <= $8::bigint THEN r.body END AS body,
  length(r.body)::bigint AS body_len
FROM (SELECT 1) AS one
LEFT JOIN idemgate_records r ON r.id = $1 AND r.expires > clock_timestamp()
";

/// The body of a completed record that a claim found longer than the room it had taken
/// (`CLAIM` returns its length alone), read once room is taken for it: in pieces of
/// [`BODY_PIECE`] bytes, a row each, from one statement (one snapshot of one record), so
/// that each piece is copied into the room taken and dropped before the next arrives (the
/// column is stored uncompressed, `MIGRATE`, so a slice reads only its own part). Read as
/// one value, each body was in memory twice (the row and its copy): 300 slow readers of a
/// 4 MiB record took a release build's peak from 44 to 140 MiB.
pub(super) const BODY: &str = "
SELECT substring(r.body FROM g FOR $3::int)
FROM idemgate_records r, LATERAL generate_series(1, length(r.body), $3::int) AS g
WHERE r.id = $1 AND r.fingerprint = $2 AND r.state = 1 AND r.expires > clock_timestamp()
ORDER BY g
";

/// The bytes of a body [`BODY`] brings per row: at 256 KiB the peak of those 300 readers
/// was 120-134 MiB, at 64 KiB 108-110 MiB (as from Redis).
pub(super) const BODY_PIECE: i32 = 64 * 1024;

pub(super) const RECORD: &str = "
UPDATE idemgate_records SET state = 1, status = $3, headers = $4, body = $5
WHERE id = $1 AND owner = $2 AND expires > clock_timestamp()
";

pub(super) const RENEW: &str = "
UPDATE idemgate_records SET lease_until = clock_timestamp() + $3::bigint * interval '1 millisecond'
WHERE id = $1 AND owner = $2 AND state = 0 AND expires > clock_timestamp()
";

/// An answer that shows nothing ran: its expiry brought forward (never later).
pub(super) const SHORTEN: &str = "
UPDATE idemgate_records
SET expires = LEAST(expires, clock_timestamp() + $3::bigint * interval '1 millisecond')
WHERE id = $1 AND owner = $2 AND expires > clock_timestamp()
";

pub(super) const MARK_UNKNOWN: &str = "
UPDATE idemgate_records SET state = 2
WHERE id = $1 AND owner = $2 AND state <> 1 AND expires > clock_timestamp()
";

/// Deletes the owner's record, or (none) remembers the withdrawal: one statement.
pub(super) const RELEASE: &str = "
WITH d AS (
  DELETE FROM idemgate_records
  WHERE id = $1 AND owner = $2 AND expires > clock_timestamp()
  RETURNING 1
), w AS (
  INSERT INTO idemgate_withdrawn AS x (id, owner, until)
  SELECT $1::bytea, $2::text, clock_timestamp() + $3::bigint * interval '1 millisecond'
  WHERE NOT EXISTS (SELECT 1 FROM d)
  ON CONFLICT (id, owner) DO UPDATE SET until = greatest(x.until, excluded.until)
  RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM d)
";

/// 0 not found, 1 deleted, 2 owner busy, 4 written without a namespace and `$4` (any
/// namespace) not given: one statement. Only a record of namespace `$3`, or of none, is
/// found.
pub(super) const DELETE: &str = "
WITH cur AS (
  SELECT state, lease_until, busy_until, namespace IS NULL AND NOT $4 AS unreached
  FROM idemgate_records
  WHERE id = $1 AND expires > clock_timestamp() AND (namespace = $3 OR namespace IS NULL)
  FOR UPDATE
), d AS (
  DELETE FROM idemgate_records
  WHERE id = $1 AND EXISTS (SELECT 1 FROM cur WHERE NOT unreached) AND ($2 OR NOT EXISTS (
    SELECT 1 FROM cur WHERE state = 0
      AND (lease_until > clock_timestamp() OR busy_until > clock_timestamp())))
  RETURNING 1
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM d) THEN 1
            WHEN EXISTS (SELECT 1 FROM cur WHERE unreached) THEN 4
            WHEN EXISTS (SELECT 1 FROM cur) THEN 2 ELSE 0 END
";

// An operator's resolution: 1 completed, 0 no record (of namespace `$6`, or of none), 2
// its owner may still be working (not forced), 3 already completed (kept or not), 4
// written without a namespace and `$7` (any namespace) not given. The owner is cleared, so
// the former owner's late RECORD is refused.
pub(super) const COMPLETE: &str = "
WITH cur AS (
  SELECT state, lease_until, busy_until, namespace IS NULL AND NOT $7 AS unreached
  FROM idemgate_records
  WHERE id = $1 AND expires > clock_timestamp() AND (namespace = $6 OR namespace IS NULL)
  FOR UPDATE
), u AS (
  UPDATE idemgate_records SET state = 1, owner = '', status = $3, headers = $4, body = $5
  WHERE id = $1 AND EXISTS (SELECT 1 FROM cur WHERE state <> 1 AND NOT unreached)
    AND ($2 OR NOT EXISTS (
    SELECT 1 FROM cur WHERE state = 0
      AND (lease_until > clock_timestamp() OR busy_until > clock_timestamp())))
  RETURNING 1
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM u) THEN 1
            WHEN NOT EXISTS (SELECT 1 FROM cur) THEN 0
            WHEN EXISTS (SELECT 1 FROM cur WHERE unreached) THEN 4
            WHEN EXISTS (SELECT 1 FROM cur WHERE state = 1) THEN 3 ELSE 2 END
";

// While observing: a later execution's answer replaces a completed record's answer (kept or
// not) whose status is outside 2xx, when the fingerprint `$2` is the record's.
pub(super) const SUPERSEDE: &str = "
UPDATE idemgate_records SET status = $3, headers = $4, body = $5
WHERE id = $1 AND expires > clock_timestamp() AND state = 1 AND fingerprint = $2
  AND (status IS NULL OR status < 200 OR status >= 300)
";

// The columns a record view starts with (see `view_of`), as INSPECT and LIST select them.
macro_rules! view_columns {
    () => {
        "
SELECT state, fingerprint, fingerprint_version,
  (extract(epoch FROM (lease_until - clock_timestamp())) * 1000)::bigint,
  (extract(epoch FROM (busy_until - clock_timestamp())) * 1000)::bigint,
  (extract(epoch FROM created) * 1000)::bigint,
  (extract(epoch FROM (expires - clock_timestamp())) * 1000)::bigint,
  status, "
    };
}

// The columns of a record view (see `view_of`), `$2`: with its body; only a record of
// namespace `$3`, or of none.
pub(super) const INSPECT: &str = concat!(
    view_columns!(),
    "CASE WHEN $2 THEN body END, headers IS NOT NULL, NULL::bytea, namespace
FROM idemgate_records WHERE id = $1 AND expires > clock_timestamp()
  AND (namespace = $3 OR namespace IS NULL)
"
);

// One page of an operator's walk: the next `$2` live records after the id `$1`, in
// primary-key order (an index range scan: about `$2` rows read per page), with the
// columns of INSPECT and the id before the namespace (records of other namespaces are
// left out by the caller, so that a page reads `$2` rows whatever the namespaces).
pub(super) const LIST: &str = concat!(
    view_columns!(),
    "NULL::bytea, headers IS NOT NULL, id, namespace
FROM idemgate_records WHERE id > $1 AND expires > clock_timestamp()
ORDER BY id LIMIT $2
"
);

// Moves the heartbeat forward to the database's now (never back: `greatest`, whatever the
// clocks of the servers it moves between), and reads what it was before: one statement.
pub(super) const HEARTBEAT: &str = "
WITH old AS (SELECT value FROM idemgate_meta WHERE name = 'heartbeat'), up AS (
  INSERT INTO idemgate_meta AS m (name, value)
  VALUES ('heartbeat', ((extract(epoch FROM clock_timestamp()) * 1000)::bigint)::text)
  ON CONFLICT (name) DO UPDATE
    SET value = greatest(m.value::bigint, excluded.value::bigint)::text
  RETURNING value
)
SELECT (SELECT value FROM old), (SELECT value FROM up)
";

pub(super) const SWEEP: &str = "
WITH d AS (
  DELETE FROM idemgate_records WHERE id IN (
    SELECT id FROM idemgate_records WHERE expires <= clock_timestamp()
    ORDER BY expires LIMIT $1 FOR UPDATE SKIP LOCKED)
  RETURNING 1
), w AS (
  DELETE FROM idemgate_withdrawn WHERE ctid IN (
    SELECT ctid FROM idemgate_withdrawn WHERE until <= clock_timestamp() LIMIT $1)
)
SELECT count(*) FROM d
";
