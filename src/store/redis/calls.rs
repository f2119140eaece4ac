//! The [`Store`] calls, each one script or one round trip.

use super::*;

/// Appends an answer as the scripts that write one take it: status, encoded headers, body.
fn push_answer(cmd: &mut Cmd, response: &StoredResponse) {
    cmd.arg(response.status.to_string())
        .arg(response.encode_headers())
        .arg(&response.body[..]);
}

impl Store for RedisStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> StoreFuture<'a, Claim> {
        Box::pin(async move {
            let value = self.value_records.then(|| claim_value(req));
            // A value-form claim is first the bare command, unless the claim holds no room
            // at all (then a script brings a body only once room is found for it).
            let bare = value
                .as_ref()
                .filter(|_| req.room.as_ref().is_none_or(|r| r.held() > 0));
            if let Some(value) = bare {
                if let Some(claim) = self.claim_bare(req, value).await? {
                    return Ok(claim);
                }
            }
            let mut cmd = evalsha(&self.scripts.claim, &Self::key(&req.id));
            cmd.arg(&hex64(&req.fingerprint.0)[..])
                .arg(req.fingerprint_version)
                .arg(req.owner.as_str())
                .arg(req.lease.as_millis() as u64)
                .arg(req.retention.as_millis() as u64)
                .arg(req.busy_for.as_millis() as u64)
                // Inline bodies up to the room taken for them come back with the claim;
                // the claim reads a longer one's length, and takes room for it first.
                .arg(req.room.as_ref().map_or(INLINE_MAX, ReplayRoom::held));
            if let Some(value) = &value {
                cmd.arg(&value[..]);
            }
            let (v, acked) = self.eval(&self.scripts.claim, cmd, true).await?;
            let claim = match parse_claim(v)? {
                Parsed::Claim(c) => c,
                Parsed::Large {
                    status,
                    headers,
                    at,
                    len,
                } if crate::store::room_for(req.room.as_ref(), len) => {
                    let body = self.read_large(&req.id, at, len).await?;
                    Claim::Replay(StoredResponse {
                        status,
                        headers,
                        body,
                    })
                }
                // No room for the body now: it stays in Redis, unread.
                Parsed::Large { status, .. } => Claim::NoRoom { status },
            };
            self.claim_acknowledged(req, claim, acked).await
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            if response.body.len() > INLINE_MAX {
                return self.record_large(id, owner, response).await;
            }
            let status = response.status.to_string();
            let headers = response.encode_headers();
            if self.value_records && response.body.len() <= VALUE_BODY_MAX {
                let mut answer = Vec::with_capacity(11 + headers.len() + response.body.len());
                answer.extend_from_slice(answer_head(response.status, headers.len()).as_bytes());
                answer.extend_from_slice(&headers);
                answer.extend_from_slice(&response.body);
                let script = &self.scripts.record_value;
                let mut cmd = evalsha(script, &Self::key(id));
                cmd.arg(owner.as_str()).arg(answer);
                let reply = self.call(Some(script), cmd, true).await?;
                // `None`: a hash record (claimed over withdrawal notes, or by a hash-writing
                // instance), for RECORD below.
                if let Some(written) = self.record_reply(reply)? {
                    return Ok(written);
                }
            }
            // A value-form record with an answer too large for a value becomes its hash.
            let script = if self.value_records {
                &self.scripts.record_hash
            } else {
                &self.scripts.record
            };
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(owner.as_str())
                .arg(status)
                .arg(headers)
                .arg(&response.body[..]);
            let reply = self.call(Some(script), cmd, true).await?;
            // `None`: a value at the key, where this instance claims hashes (and nothing
            // turns a hash into a value): another claim's record.
            Ok(self.record_reply(reply)?.unwrap_or(false))
        })
    }

    fn shorten<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        retain: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let ms = retain.as_millis().max(1).to_string();
            let args: [&[u8]; 1] = [ms.as_bytes()];
            self.owner_checked(&self.scripts.shorten, id, owner, &args, None)
                .await
        })
    }

    fn record_not_kept<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        status: u16,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let head = answer_head(status, 0);
            let status = status.to_string();
            let args: [&[u8]; 2] = [status.as_bytes(), head.as_bytes()];
            self.owner_checked(
                &self.scripts.record_not_kept,
                id,
                owner,
                &args,
                Some("record"),
            )
            .await
        })
    }

    fn renew<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let lease_ms = lease.as_millis().to_string();
            self.owner_checked(&self.scripts.renew, id, owner, &[lease_ms.as_bytes()], None)
                .await
        })
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
    ) -> StoreFuture<'a, bool> {
        Box::pin(self.owner_checked(&self.scripts.mark_unknown, id, owner, &[], None))
    }

    fn release<'a>(
        &'a self,
        id: &'a RecordId,
        owner: &'a OwnerToken,
        linger: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let script = &self.scripts.release;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(owner.as_str())
                // At least a millisecond: PEXPIRE 0 would delete the note at once.
                .arg((linger.as_millis() as u64).max(1));
            match self.eval(script, cmd, false).await? {
                (Value::Int(n), _) => Ok(n == 1),
                _ => Err(corrupt("release reply")),
            }
        })
    }

    fn inspect<'a>(
        &'a self,
        id: &'a RecordId,
        with_body: bool,
    ) -> StoreFuture<'a, Option<RecordView>> {
        Box::pin(async move {
            let script = &self.scripts.inspect;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(if with_body { "1" } else { "0" });
            let (v, _) = self.eval(script, cmd, false).await?;
            let items = match v {
                Value::Nil => return Ok(None),
                Value::Array(items) => items,
                _ => return Err(corrupt("inspect reply")),
            };
            let text = |i: usize| items.get(i).and_then(text_of).unwrap_or_default();
            let num = |i: usize| text(i).parse::<i64>().ok();
            let now = num(6).unwrap_or(0);
            let lease_until = num(3);
            let busy_until = num(9);
            let st = text(0);
            let state = match st.as_str() {
                "c" | "n" => RecordState::Completed,
                "p" if lease_until.is_some_and(|l| l > now) => RecordState::InProgress,
                _ => RecordState::Unknown,
            };
            Ok(Some(RecordView {
                id: id.to_string(),
                state,
                created_ms: num(4).unwrap_or(0).max(0) as u64,
                lease_left_ms: match state {
                    RecordState::InProgress => lease_until.map(|l| (l - now).max(0) as u64),
                    _ => None,
                },
                ttl_ms: num(7).filter(|t| *t >= 0).map(|t| t as u64),
                owner_busy_ms: match text(0).as_str() {
                    "p" => busy_until.filter(|b| *b > now).map(|b| (b - now) as u64),
                    _ => None,
                },
                fingerprint: text(1),
                fingerprint_version: text(2).parse().unwrap_or(0),
                status: text(5).parse().ok(),
                body_kept: (state == RecordState::Completed).then_some(st == "c"),
                body: match (with_body, items.get(8).and_then(bytes_of)) {
                    (false, _) => None,
                    (true, Some(b)) => Some(String::from_utf8_lossy(&b).into_owned()),
                    // A large body: read a piece at a time, as a replay reads it.
                    (true, None) => {
                        // (A value record's body always comes with the script's reply.)
                        let large = match (num(10), num(11)) {
                            (Some(len), _) => Some((Body::Pieces, len)),
                            (None, Some(len)) => Some((Body::OldKey, len)),
                            _ => None,
                        };
                        match large {
                            Some((at, len)) => {
                                let len = usize::try_from(len)
                                    .map_err(|_| corrupt("a large body's length"))?;
                                let b = self.read_large(id, at, len).await?;
                                Some(String::from_utf8_lossy(&b).into_owned())
                            }
                            None => None,
                        }
                    }
                },
                namespace: None,
            }))
        })
    }

    fn delete<'a>(
        &'a self,
        id: &'a RecordId,
        force: bool,
        _any_namespace: bool,
    ) -> StoreFuture<'a, Deleted> {
        Box::pin(async move {
            let script = &self.scripts.delete;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(if force { "1" } else { "0" });
            let n = match self.eval(script, cmd, false).await? {
                (Value::Int(n), _) => n,
                _ => return Err(corrupt("delete reply")),
            };
            if n == 4 {
                // Written by the previous version, whose large bodies had a key of their
                // own. Not in the script, which names the record alone (see the module's
                // comment); should this fail, the body expires a minute after the record
                // would have, and nothing reads it in the meantime.
                let mut del = redis::cmd("DEL");
                del.arg(&Self::old_body_key(id)[..]);
                let _: Result<i64, _> = query_keyed(&mut self.conn.clone(), &del).await;
            }
            match n {
                1 | 4 => Ok(Deleted::Deleted),
                0 => Ok(Deleted::NotFound),
                2 => Ok(Deleted::OwnerBusy),
                _ => Err(corrupt("delete reply")),
            }
        })
    }

    fn complete<'a>(
        &'a self,
        id: &'a RecordId,
        response: &'a StoredResponse,
        force: bool,
        _any_namespace: bool,
    ) -> StoreFuture<'a, Completed> {
        Box::pin(async move {
            let script = &self.scripts.complete;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(if force { "1" } else { "0" });
            push_answer(&mut cmd, response);
            // Waits for replicas like a record: a completion lost in a failover would leave
            // the record `unknown` again.
            let (v, acked) = self.eval(script, cmd, true).await?;
            let n = match v {
                Value::Int(n) => n,
                _ => return Err(corrupt("complete reply")),
            };
            if n == 1 {
                self.acknowledged("completion", acked)?;
            }
            Completed::from_code(n).ok_or_else(|| corrupt("complete reply"))
        })
    }

    fn supersede<'a>(
        &'a self,
        id: &'a RecordId,
        fingerprint: &'a crate::fingerprint::Fingerprint,
        response: &'a StoredResponse,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let script = &self.scripts.supersede;
            let mut cmd = evalsha(script, &Self::key(id));
            cmd.arg(&hex64(&fingerprint.0)[..]);
            push_answer(&mut cmd, response);
            self.answer_written(script, cmd, "superseding answer", "supersede reply")
                .await
        })
    }

    fn list<'a>(
        &'a self,
        state: Option<RecordState>,
        cursor: &'a str,
        count: usize,
    ) -> StoreFuture<'a, Page> {
        Box::pin(async move {
            // SCAN, never KEYS: each call costs Redis about `count` keys' work, and a
            // record that exists for the whole walk is returned at least once.
            // A cluster's keys are spread over its primaries, each with its own SCAN
            // cursor; a walk over one of them would look complete and miss the others.
            if self.conn.is_cluster() {
                return Err(StoreError::Backend(
                    "listing records is not available on Redis Cluster: look records up one \
                     by one (POST /records/lookup, GET /records/{id})"
                        .into(),
                ));
            }
            let start = if cursor.is_empty() { "0" } else { cursor };
            if !start.bytes().all(|b| b.is_ascii_digit()) {
                return Err(corrupt("not a cursor of this store"));
            }
            let mut c = self.conn.clone();
            let (next, keys): (String, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(start)
                .arg("MATCH")
                .arg("idemgate:{*}")
                .arg("COUNT")
                .arg(count.max(1))
                .query_async(&mut c)
                .await
                .map_err(backend)?;
            // Each record's state field, the whole page in one pipeline of bare HGETs, so
            // that only the records that can be in the state asked for are inspected (a
            // script each): the walk that counts the records held `unknown` (every
            // `unknown_count_interval`, on every instance) otherwise ran one INSPECT per
            // live record, nearly all of them completed.
            // A value record (`value.rs`) refuses HGET (`WRONGTYPE`); its state is its first
            // byte, read for those alone in a second pipeline.
            let mut states: Vec<Option<Vec<u8>>> = Vec::with_capacity(keys.len());
            let mut values = Vec::new();
            if !keys.is_empty() {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for key in &keys {
                    pipe.cmd("HGET").arg(key).arg("st");
                }
                let replies: Vec<Value> = pipe.query_async(&mut c).await.map_err(backend)?;
                for (i, reply) in replies.into_iter().enumerate() {
                    states.push(match reply {
                        Value::ServerError(e) if e.code() == "WRONGTYPE" => {
                            values.push(i);
                            None
                        }
                        Value::ServerError(e) => return Err(backend(e.into())),
                        other => bytes_of(&other).map(|b| b.to_vec()),
                    });
                }
            }
            if !values.is_empty() {
                let mut pipe = redis::pipe();
                for &i in &values {
                    pipe.cmd("GETRANGE").arg(&keys[i]).arg(0).arg(0);
                }
                let firsts: Vec<Vec<u8>> = pipe.query_async(&mut c).await.map_err(backend)?;
                for (&i, first) in values.iter().zip(firsts) {
                    // Gone since (empty): nothing to show.
                    states[i] = (!first.is_empty()).then_some(first);
                }
            }
            let mut records = Vec::new();
            for (key, st) in keys.into_iter().zip(states) {
                if !may_be_in(st.as_deref(), state) {
                    continue;
                }
                let Some(id) = key
                    .strip_prefix(KEY_PREFIX)
                    .and_then(|k| k.strip_suffix(b"}"))
                    .and_then(|hex| std::str::from_utf8(hex).ok())
                    .and_then(RecordId::from_hex)
                else {
                    continue;
                };
                // Gone since the scan saw it: nothing to show.
                let Some(view) = self.inspect(&id, false).await? else {
                    continue;
                };
                if state.is_none_or(|s| s == view.state) {
                    records.push(view);
                }
            }
            Ok(Page {
                records,
                cursor: (next != "0").then_some(next),
            })
        })
    }

    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let mut c = self.conn.clone();
            let _: String = redis::cmd("PING")
                .query_async(&mut c)
                .await
                .map_err(backend)?;
            Ok(())
        })
    }

    fn kind(&self) -> crate::store::StoreKind {
        crate::store::StoreKind::Redis
    }

    fn can_list(&self) -> bool {
        !self.conn.is_cluster()
    }

    fn meta<'a>(&'a self, name: &'a str, offer: Option<&'a str>) -> StoreFuture<'a, Meta> {
        Box::pin(async move {
            if self.conn.is_cluster() {
                return self.cluster_meta(name, offer).await;
            }
            let key = meta_key(name);
            let mut c = self.conn.clone();
            // SET NX, then GET: whichever instance came first, every instance reads the one
            // value that won. Two commands rather than `SET NX GET`, which Redis before
            // 7.0 refuses; this runs at start-up and every `scope_secret_check_interval`.
            let created = match offer {
                Some(v) => meta_set_if_absent(&mut c, &key, v).await?,
                None => false,
            };
            let value = meta_get(&mut c, &key).await?;
            // Every record id hangs on the secret: one lost in a failover would orphan every
            // record. With replica acknowledgement on, it must be on the replicas too.
            // A replica that has only just finished its first sync can let a WAIT run out
            // although it is online (seen with Redis 7.0: 0 of 1 within 200 ms, three times
            // in ten, right after the primary listed it as online). Start-up is in no hurry:
            // the acknowledgement gets `SECRET_ACK_TRIES` tries before idemgate gives up.
            if offer.is_some() {
                self.meta_acknowledged(&mut c).await?;
            }
            Ok(Meta { value, created })
        })
    }

    fn server_stats(&self) -> StoreFuture<'_, Option<ServerStats>> {
        Box::pin(async move {
            // The default sections hold all four fields; `all` would add per-command ones.
            // A cluster's primaries are read as one server: a restart of any changes the
            // run id, evictions add up, the youngest uptime and any evicting policy show.
            let infos = self.info_all("default").await?;
            let number = |info: &str, name: &str| {
                info_field(info, name)
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or_else(|| corrupt(&format!("INFO without {name}")))
            };
            let mut run_ids = Vec::new();
            let (mut uptime, mut evicted) = (u64::MAX, 0u64);
            let mut policy = String::new();
            for info in &infos {
                run_ids.push(
                    info_field(info, "run_id").ok_or_else(|| corrupt("INFO without run_id"))?,
                );
                uptime = uptime.min(number(info, "uptime_in_seconds")?);
                evicted += number(info, "evicted_keys")?;
                let p = info_field(info, "maxmemory_policy").unwrap_or_default();
                if policy.is_empty() || p != "noeviction" {
                    policy = p;
                }
            }
            run_ids.sort();
            Ok(Some(ServerStats {
                run_id: run_ids.join(","),
                uptime_secs: uptime,
                evicted_keys: evicted,
                maxmemory_policy: policy,
            }))
        })
    }
}

/// Whether a record whose state field (`st`) read `st` may show as `state` (any, if
/// `None`) when inspected: completed (`c`, `n`) is for good, in progress (`p`) reads as
/// `unknown` once its lease runs out, and no field is no record (withdrawal notes alone).
/// [`inspect`](Store::inspect) decides; this only spares it the records that cannot match.
fn may_be_in(st: Option<&[u8]>, state: Option<RecordState>) -> bool {
    match (st, state) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(b"c" | b"n"), Some(s)) => s == RecordState::Completed,
        (Some(b"p"), Some(s)) => s != RecordState::Completed,
        (Some(_), Some(s)) => s == RecordState::Unknown,
    }
}
