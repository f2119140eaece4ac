//! Values kept beside the records (the scope secret and its verifiers), and on a Cluster
//! their copies on every primary.

use super::*;

/// Where the record-id secret lives: outside any record's hash tag, read at start-up and
/// checked (put back if missing) every `scope_secret_check_interval` (see
/// [`crate::secret`]). It must outlive every record (it has no TTL, and idemgate refuses a
/// Redis that evicts); a Redis that forgets it is what the checks are for.
pub const SECRET_KEY: &str = "idemgate:scope-secret";

/// The Redis key of a [`Store::meta`] value: the scope secret where it always was, the
/// others beside it (`idemgate:scope-verifier:<namespace>`).
pub fn meta_key(name: &str) -> String {
    if name == SCOPE_SECRET {
        SECRET_KEY.to_string()
    } else {
        format!("idemgate:{}", name.replace('_', "-"))
    }
}

/// `SET key value NX`: whether this call wrote it.
pub(super) async fn meta_set_if_absent(
    c: &mut Link,
    key: &str,
    value: &str,
) -> Result<bool, StoreError> {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .query_async(c)
        .await
        .map_err(backend)?;
    Ok(set.is_some())
}

/// `GET key` of a meta value.
pub(super) async fn meta_get(c: &mut Link, key: &str) -> Result<Option<String>, StoreError> {
    redis::cmd("GET")
        .arg(key)
        .query_async(c)
        .await
        .map_err(backend)
}

/// One hash tag per primary in a `CLUSTER SLOTS` reply: the first of `s0`, `s1`, ... whose
/// slot that primary serves. Every instance computes the same tags from the same slot map;
/// after a resharding the tags move with it, and the next check writes the copies anew.
pub(super) fn copy_tags(slots: &Value) -> Vec<String> {
    use std::collections::BTreeMap;
    // Ranges by primary (the first node of each range).
    let mut primaries: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for range in crate::store::redis::link::slot_ranges(slots) {
        if let Some((host, port)) = range.nodes.first() {
            primaries
                .entry(format!("{host}:{port}"))
                .or_default()
                .push((range.from, range.to));
        }
    }
    primaries
        .values()
        .filter_map(|ranges| {
            (0..65_536).map(|i| format!("s{i}")).find(|tag| {
                let slot = i64::from(key_slot(tag.as_bytes()));
                ranges
                    .iter()
                    .any(|(from, to)| (*from..=*to).contains(&slot))
            })
        })
        .collect()
}

/// The cluster slot of a key without a hash tag (CRC16/XMODEM modulo 16384).
pub(super) fn key_slot(key: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(key) % 16_384
}

/// How many times start-up waits for the replicas to acknowledge the scope secret (each
/// wait `replica_ack_timeout`) before it gives up.
pub const SECRET_ACK_TRIES: u32 = 5;

impl RedisStore {
    /// [`Store::meta`] on a Cluster: the value under its usual key and under one copy per
    /// primary (`<key>:{<tag>}`, a hash tag in a slot that primary serves, see
    /// [`copy_tags`]), so that losing any one shard (a primary restarted empty, a
    /// `FLUSHALL` of one node) loses no meta value: every instance, a starting one
    /// included, reads it from the copies that are left and puts the missing ones back.
    ///
    /// Reads every copy; if they hold two different values, nothing is decided (an error:
    /// the store is inconsistent and an operator must say which secret is the one). If
    /// one value is found, it is written, set-if-absent, wherever it is missing. If none
    /// is, `offer` is set-if-absent under the usual key (whoever came first wins, as on
    /// one server), and what won is copied to every primary.
    pub(super) async fn cluster_meta(
        &self,
        name: &str,
        offer: Option<&str>,
    ) -> Result<Meta, StoreError> {
        let key = meta_key(name);
        let mut c = self.conn.clone();
        let slots: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut c)
            .await
            .map_err(backend)?;
        let mut keys = vec![key.clone()];
        keys.extend(copy_tags(&slots).iter().map(|t| format!("{key}:{{{t}}}")));
        let mut found: Vec<Option<String>> = Vec::with_capacity(keys.len());
        for k in &keys {
            found.push(meta_get(&mut c, k).await?);
        }
        let mut values: Vec<&String> = found.iter().flatten().collect();
        values.sort();
        values.dedup();
        let (value, mut created) = match values.as_slice() {
            [] => match offer {
                None => {
                    return Ok(Meta {
                        value: None,
                        created: false,
                    })
                }
                Some(v) => {
                    let set = meta_set_if_absent(&mut c, &key, v).await?;
                    let won = meta_get(&mut c, &key).await?;
                    found[0] = won.clone();
                    match won {
                        Some(w) => (w, set),
                        None => return Err(corrupt(&format!("{key} vanished as it was set"))),
                    }
                }
            },
            [one] => ((*one).clone(), false),
            _ => {
                return Err(StoreError::Backend(format!(
                    "the copies of {key} on the cluster's primaries hold {} different values; \
                     delete the wrong ones (or pin the scope secret) to go on",
                    values.len()
                )))
            }
        };
        for (k, v) in keys.iter().zip(&found) {
            if v.is_none() {
                let set = meta_set_if_absent(&mut c, k, &value).await?;
                // Putting back what another copy held is restoring; `created` says that
                // this instance's offer went in somewhere.
                created |= set && offer == Some(value.as_str());
            }
        }
        if offer.is_some() {
            self.meta_acknowledged(&mut c).await?;
        }
        Ok(Meta {
            value: Some(value),
            created,
        })
    }

    /// With replica acknowledgement on, waits until the replicas have what this
    /// connection wrote, `SECRET_ACK_TRIES` times at most.
    pub(super) async fn meta_acknowledged(&self, c: &mut Link) -> Result<(), StoreError> {
        let Some(ack) = self.replica_ack else {
            return Ok(());
        };
        let mut acked = 0;
        for _ in 0..SECRET_ACK_TRIES {
            acked = redis::cmd("WAIT")
                .arg(ack.replicas)
                .arg(ack.timeout.as_millis() as u64)
                .query_async(c)
                .await
                .map_err(backend)?;
            if acked >= i64::from(ack.replicas) {
                break;
            }
        }
        self.acknowledged("the scope secret", Some(acked))
    }
}
