//! What a commit of idemgate's sessions is worth: the `synchronous_commit` they run with,
//! and whether the server replicates to standbys that a failover could promote without the
//! last commits (asynchronous replication: no `synchronous_standby_names`); and the
//! heartbeat that shows when the database went back in time all the same.

use super::{col, corrupt, pg, PostgresStore};
use crate::store::{Heartbeat, StoreError};

/// The server's replication, as idemgate's session reads it at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Durability {
    /// `synchronous_commit` as the session has it (`postgres_synchronous_commit`, whatever
    /// the server's or the database's default).
    pub synchronous_commit: String,
    /// Standbys streaming from this server now (`pg_stat_replication` rows).
    pub standbys: i64,
    /// The server's `synchronous_standby_names` (empty: none are synchronous).
    pub synchronous_standby_names: String,
}

const READ: &str = "
SELECT current_setting('synchronous_commit'), (SELECT count(*) FROM pg_stat_replication),
  current_setting('synchronous_standby_names')
";

impl PostgresStore {
    /// Reads [`Durability`] on the shared session (one statement, any privilege: rows of
    /// `pg_stat_replication` are visible to every role, their details are not).
    pub async fn durability(&self) -> Result<Durability, StoreError> {
        let c = self.conn().await?;
        let row = c.client.query_one(READ, &[]).await.map_err(pg)?;
        Ok(Durability {
            synchronous_commit: col(&row, 0)?,
            standbys: col(&row, 1)?,
            synchronous_standby_names: col(&row, 2)?,
        })
    }
}

impl PostgresStore {
    /// [`Store::heartbeat`](crate::store::Store::heartbeat): the `heartbeat` row of
    /// `idemgate_meta`, one statement on the shared connection.
    pub(super) async fn beat(&self) -> Result<Heartbeat, StoreError> {
        let c = self.conn().await?;
        let row = c.client.query_one(&c.heartbeat, &[]).await.map_err(pg)?;
        let ms = |v: Option<String>| -> Result<Option<i64>, StoreError> {
            v.map(|v| v.parse().map_err(|_| corrupt("heartbeat is not a number")))
                .transpose()
        };
        let before = ms(col(&row, 0)?)?;
        let now = ms(col(&row, 1)?)?.ok_or_else(|| corrupt("no heartbeat written"))?;
        Ok(Heartbeat { before, now })
    }
}

impl Durability {
    /// What a failover could lose, said as a warning; `None` when commits wait for the
    /// standbys (or there are none), or when `acknowledged`
    /// (`postgres_async_standbys_acknowledged`).
    pub fn warning(&self, acknowledged: bool) -> Option<String> {
        if acknowledged || self.standbys == 0 {
            return None;
        }
        let n = self.standbys;
        let standbys = if n == 1 { "standby" } else { "standbys" };
        let loses = "a failover to one loses the claims and answers written in its replication lag, and the retries of those keys execute again (a second payment)";
        let fix = "or, where the service replicates below SQL (a managed service's storage) or that loss is accepted, set postgres_async_standbys_acknowledged = true";
        if self.synchronous_standby_names.trim().is_empty() {
            return Some(format!(
                "PostgreSQL streams to {n} {standbys} asynchronously (synchronous_standby_names is empty): {loses}. Name them in synchronous_standby_names on the server, {fix}"
            ));
        }
        if self.synchronous_commit == "local" {
            return Some(format!(
                "PostgreSQL streams to {n} {standbys}, but idemgate's sessions commit with synchronous_commit = local, which does not wait for the synchronous ones: {loses}. Set postgres_synchronous_commit = \"on\" (or remote_write, remote_apply), {fix}"
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(commit: &str, standbys: i64, names: &str) -> Durability {
        Durability {
            synchronous_commit: commit.into(),
            standbys,
            synchronous_standby_names: names.into(),
        }
    }

    #[test]
    fn asynchronous_standbys_are_warned_about_unless_acknowledged() {
        let asynchronous = seen("on", 2, "");
        let warning = asynchronous.warning(false).expect("a warning");
        assert!(warning.contains("2 standbys asynchronously"), "{warning}");
        assert!(warning.contains("a failover to one loses"), "{warning}");
        assert_eq!(asynchronous.warning(true), None);
        assert_eq!(seen("on", 0, "").warning(false), None);
        assert_eq!(seen("on", 1, "ANY 1 (s1, s2)").warning(false), None);
        assert_eq!(seen("remote_apply", 1, "s1").warning(false), None);
        let local = seen("local", 1, "s1").warning(false).expect("a warning");
        assert!(local.contains("synchronous_commit = local"), "{local}");
    }
}
