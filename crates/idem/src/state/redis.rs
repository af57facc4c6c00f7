//! The state in Redis: one entry per emitted key, shared by every job that writes the
//! stream, expired by the server.
//!
//! ```text
//!  PREFIX:meta          the key and version layout the state was built with (JSON)
//!  PREFIX:clock         newest event time, watermark and version of the committed runs
//!  PREFIX:runs          fingerprints of applied batches, scored by their commit time
//!  PREFIX:expiry        live entries per minute of expiry (for `keys` and `expired`)
//!  PREFIX:e:<16 bytes>  one entry: the key's XXH3-128 hash (as the file state uses) →
//!                       deleted · newest event time · run tag · encoded version
//!                       [· the same of the entry this run replaced]
//! ```
//!
//! Each winner is judged exactly as the file state judges it ([`judge`]). It is first judged
//! as if its key were new and claimed with `SET … NX GET` (pipelined): the server sets the
//! entry only if the key is absent, and otherwise returns what it holds; such a key is
//! judged again on that and written by a Lua compare-and-set, only if the entry still holds
//! what the run read (otherwise the run decides again). So two jobs racing on a key emit it
//! once in total, and a newer version is never overwritten by an older one.
//!
//! Redis cannot commit together with the output, and entries are written before it (that is
//! what makes two racing jobs exclusive). An entry therefore carries the tag of the run
//! that wrote it (a hash of its input fingerprint) and the entry it replaced: a run reading
//! an entry under its own tag judges the replaced one instead, so a re-run after a crash at
//! any moment makes the decisions of an uninterrupted run and writes the same entries.
//! The batch is marked applied last, after its output; a failed run puts back the entries
//! it replaced. Entries expire at their event time + retention + safety buffer, on the
//! server's clock; an entry older than the committed watermark counts as gone even while
//! the server still holds it, as in the file state.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{BooleanArray, RecordBatch};
use arrow::compute::filter_record_batch;
use idem_core::DedupSpec;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError, Script, Value};
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::{
    BatchFacts, Known, Layout, Layouts, Prepared, StateFilter, StateOptions, StateReport, Verdict,
    WinnerFilter, Winners, judge, late_error, rfc3339,
};
use crate::error::{Error, Result};
use crate::pg::redact_location;
use crate::units::now_millis;

const FORMAT: &str = "idem-state-redis/1";
/// The prefix of a URL without `?prefix=`.
const DEFAULT_PREFIX: &str = "idem";
/// Entries per `MGET` and per compare-and-set: large enough that the round trips do not
/// count, small enough that one script does not hold the server for long.
const CHUNK: usize = 4096;
/// Applied batches remembered, to recognise a re-run of the same inputs.
const REMEMBERED_RUNS: usize = 1000;
/// Rounds of compare-and-set for one batch before a run gives up on a contended key.
const MAX_ROUNDS: usize = 64;
const MINUTE_MS: i64 = 60_000;

/// Writes each entry only if it holds what the run read. KEYS[1] is the expiry-count hash,
/// KEYS[2..] the entries; ARGV has five values per entry: the value read ('' = absent),
/// the value to write ('' = delete), its expiry (ms since the epoch), and the minutes of
/// expiry of the old and the new value. Returns the entries that had changed, as
/// (index, current value) pairs.
const COMPARE_AND_SET: &str = r"
local deltas = {}
local conflicts = {}
for i = 2, #KEYS do
  local a = (i - 2) * 5
  local current = redis.call('GET', KEYS[i]) or ''
  if current == ARGV[a + 1] then
    local value = ARGV[a + 2]
    if value == '' then
      redis.call('DEL', KEYS[i])
    else
      redis.call('SET', KEYS[i], value, 'PXAT', ARGV[a + 3])
    end
    if current ~= '' then deltas[ARGV[a + 4]] = (deltas[ARGV[a + 4]] or 0) - 1 end
    if value ~= '' then deltas[ARGV[a + 5]] = (deltas[ARGV[a + 5]] or 0) + 1 end
  else
    conflicts[#conflicts + 1] = i - 1
    conflicts[#conflicts + 1] = current
  end
end
for minute, delta in pairs(deltas) do
  if delta ~= 0 then redis.call('HINCRBY', KEYS[1], minute, delta) end
end
return conflicts
";

/// Marks a batch applied, unless it is already, and advances the clock; then drops the
/// expiry counts of minutes that have passed. KEYS: runs, clock, expiry. ARGV: fingerprint,
/// now (ms), newest event time and watermark (µs, '' = none), runs remembered. Returns
/// {newly applied (1/0), version, expired, live keys}.
const COMMIT: &str = r"
local applied = 0
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  applied = 1
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[5]) + 1))
  for i, field in ipairs({'max_event_time_us', 'watermark_us'}) do
    local new = ARGV[2 + i]
    if new ~= '' then
      local old = redis.call('HGET', KEYS[2], field)
      if not old or tonumber(new) > tonumber(old) then
        redis.call('HSET', KEYS[2], field, new)
      end
    end
  end
  redis.call('HINCRBY', KEYS[2], 'version', 1)
end
local version = tonumber(redis.call('HGET', KEYS[2], 'version') or '0')
local now = tonumber(ARGV[2])
local expired, live = 0, 0
local counts = redis.call('HGETALL', KEYS[3])
for i = 1, #counts, 2 do
  local n = tonumber(counts[i + 1])
  if (tonumber(counts[i]) + 1) * 60000 <= now then
    expired = expired + n
    redis.call('HDEL', KEYS[3], counts[i])
  else
    live = live + n
  end
end
return {applied, version, expired, live}
";

/// What `PREFIX:meta` holds.
#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    format: String,
    #[serde(flatten)]
    layout: Layout,
}

/// A connection to the server, with the runtime that drives it (the dedup is synchronous:
/// it waits on requests, or sends them ahead and collects the replies later).
struct Server {
    runtime: Runtime,
    connection: MultiplexedConnection,
    /// The URL without its password, for messages and the report.
    display: String,
    prefix: String,
}

impl Server {
    /// Connects to `location`, `redis[s]://[USER:PASSWORD@]HOST[:PORT][/DB][?prefix=NAME]`.
    fn connect(location: &str) -> Result<Self> {
        let display = redact_location(location);
        let failed = |message: String| Error::Redis {
            target: display.clone(),
            message,
        };
        let mut url = url::Url::parse(location).map_err(|e| failed(format!("not a URL: {e}")))?;
        let mut prefix = DEFAULT_PREFIX.to_owned();
        let kept: Vec<(String, String)> = url
            .query_pairs()
            .filter_map(|(name, value)| {
                if name == "prefix" {
                    prefix = value.into_owned();
                    None
                } else {
                    Some((name.into_owned(), value.into_owned()))
                }
            })
            .collect();
        if prefix.is_empty() {
            return Err(failed("the prefix is empty".to_owned()));
        }
        url.set_query(None);
        if !kept.is_empty() {
            url.query_pairs_mut().extend_pairs(kept);
        }
        if url.scheme().eq_ignore_ascii_case("rediss") {
            // The process's rustls provider, where nothing chose one yet.
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        }
        // One worker drives the connection, so that requests are in flight while the run
        // judges the next winners.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| failed(format!("cannot start the I/O runtime: {e}")))?;
        let client = Client::open(url.as_str()).map_err(|e| failed(describe(&e)))?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(10)))
            .set_response_timeout(Some(Duration::from_secs(120)));
        let connection = runtime
            .block_on(client.get_multiplexed_async_connection_with_config(&config))
            .map_err(|e| failed(describe(&e)))?;
        let server = Self {
            runtime,
            connection,
            display,
            prefix,
        };
        // A connection is made lazily by some servers' proxies: ask something.
        server.query::<String>(&mut redis::cmd("PING"))?;
        Ok(server)
    }

    fn key(&self, name: &str) -> String {
        format!("{}:{name}", self.prefix)
    }

    fn entry_key(&self, hash: u128) -> Vec<u8> {
        let mut key = Vec::with_capacity(self.prefix.len() + 19);
        key.extend_from_slice(self.prefix.as_bytes());
        key.extend_from_slice(b":e:");
        key.extend_from_slice(&hash.to_be_bytes());
        key
    }

    fn error(&self, e: &RedisError) -> Error {
        Error::Redis {
            target: self.display.clone(),
            message: describe(e),
        }
    }

    /// Runs one command.
    fn query<T: redis::FromRedisValue>(&self, command: &mut redis::Cmd) -> Result<T> {
        let mut connection = self.connection.clone();
        self.runtime
            .block_on(command.query_async(&mut connection))
            .map_err(|e| self.error(&e))
    }

    /// Adds to `pipeline` the changes of live entries per minute of expiry, without replies.
    fn count_expiries(
        &self,
        pipeline: &mut redis::Pipeline,
        minutes: &std::collections::BTreeMap<i64, i64>,
    ) {
        for (minute, count) in minutes {
            pipeline
                .cmd("HINCRBY")
                .arg(self.key("expiry"))
                .arg(minute)
                .arg(count)
                .ignore();
        }
    }

    /// Sends `pipeline` without waiting for its replies.
    fn send_pipeline(
        &self,
        pipeline: redis::Pipeline,
    ) -> JoinHandle<redis::RedisResult<Vec<Value>>> {
        let mut connection = self.connection.clone();
        self.runtime
            .spawn(async move { pipeline.query_async(&mut connection).await })
    }

    /// The reply of a request sent ahead.
    fn wait<T>(&self, sent: JoinHandle<redis::RedisResult<T>>) -> Result<T> {
        self.runtime
            .block_on(sent)
            .map_err(|e| Error::Redis {
                target: self.display.clone(),
                message: format!("the I/O task failed: {e}"),
            })?
            .map_err(|e| self.error(&e))
    }

    /// Runs `script` with `keys` and `args`.
    fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[Vec<u8>],
        args: &[Vec<u8>],
    ) -> Result<T> {
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(key.as_slice());
        }
        for arg in args {
            invocation.arg(arg.as_slice());
        }
        let mut connection = self.connection.clone();
        self.runtime
            .block_on(invocation.invoke_async(&mut connection))
            .map_err(|e| self.error(&e))
    }
}

/// A Redis error in one line; it never holds the password.
fn describe(e: &RedisError) -> String {
    crate::error::error_line(e)
}

/// Opens the state on the server `options.location` names for `batch`.
///
/// # Errors
/// An unreachable server, refused credentials, a prefix that holds another layout or
/// something else than a state, a time column missing or not temporal.
pub(super) fn prepare(
    batch: BatchFacts,
    spec: &DedupSpec,
    options: &StateOptions,
) -> Result<Prepared> {
    let server = Server::connect(&options.location)?;
    let meta_key = server.key("meta");
    let wanted = serde_json::to_string(&Meta {
        format: FORMAT.to_owned(),
        layout: batch.layouts.layout(),
    })
    .map_err(|e| Error::InvalidArgument(format!("state layout: {e}")))?;
    // The first run of a state records its layout; every run checks it.
    let existing: Option<Vec<u8>> = server
        .query(
            redis::cmd("SET")
                .arg(&meta_key)
                .arg(&wanted)
                .arg("NX")
                .arg("GET"),
        )
        .map_err(|e| match e {
            Error::Redis { target, message } if message.contains("WRONGTYPE") => Error::Redis {
                target,
                message: format!("'{meta_key}' holds something else than an idem state"),
            },
            other => other,
        })?;
    if let Some(existing) = existing {
        check_meta(&server, &meta_key, &existing, &batch.layouts)?;
    }
    let clock: Vec<Option<i64>> = server.query(
        redis::cmd("HMGET")
            .arg(server.key("clock"))
            .arg("max_event_time_us")
            .arg("watermark_us")
            .arg("version"),
    )?;
    let field = |at: usize| clock.get(at).copied().flatten();
    let (committed_max, committed_watermark, version) = (field(0), field(1), field(2));
    let mut report = StateReport {
        location: server.display.clone(),
        late_policy: options.late.to_string(),
        version: version.map_or(0, |v| v as u64),
        max_event_time: committed_max.map(rfc3339),
        watermark: committed_watermark.map(rfc3339),
        ..StateReport::default()
    };
    let applied: Option<f64> = server.query(
        redis::cmd("ZSCORE")
            .arg(server.key("runs"))
            .arg(&batch.fingerprint),
    )?;
    if applied.is_some() {
        report.already_applied = true;
        report.keys = live_keys(&server)?;
        return Ok(Prepared::AlreadyApplied(Box::new(report)));
    }
    let (max_event_time_us, watermark_us) = batch.clock(committed_max, options)?;
    let tag = twox_hash::XxHash3_64::oneshot(batch.fingerprint.as_bytes());
    Ok(Prepared::Ready(StateFilter::Redis(Box::new(RedisState {
        server: Arc::new(server),
        compare_and_set: Script::new(COMPARE_AND_SET),
        options: options.clone(),
        spec: spec.clone(),
        width: batch.layouts.versions.width(),
        layouts: batch.layouts,
        fingerprint: batch.fingerprint,
        tag,
        committed_watermark,
        max_event_time_us,
        watermark_us,
        report,
        winners: Winners::default(),
        recorded: Vec::new(),
    }))))
}

/// The prefix must hold a state of this batch's layout.
fn check_meta(server: &Server, meta_key: &str, existing: &[u8], layouts: &Layouts) -> Result<()> {
    let meta: Meta = serde_json::from_slice(existing).map_err(|_| Error::Redis {
        target: server.display.clone(),
        message: format!("'{meta_key}' holds something else than an idem state"),
    })?;
    if meta.format != FORMAT {
        return Err(Error::Redis {
            target: server.display.clone(),
            message: format!(
                "the state was written in format {}, this idem writes {FORMAT}",
                meta.format
            ),
        });
    }
    layouts.check(&server.display, &meta.layout)
}

/// Entries whose expiry has not passed, to the minute.
fn live_keys(server: &Server) -> Result<u64> {
    let counts: std::collections::HashMap<i64, i64> =
        server.query(redis::cmd("HGETALL").arg(server.key("expiry")))?;
    let now = now_millis();
    Ok(counts
        .iter()
        .filter(|&(&minute, _)| (minute + 1) * MINUTE_MS > now)
        .map(|(_, n)| (*n).max(0) as u64)
        .sum())
}

/// One entry's state, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    deleted: bool,
    time: i64,
    tag: u64,
    version: Vec<u8>,
}

impl Entry {
    fn encoded_len(width: usize) -> usize {
        17 + width
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(u8::from(self.deleted));
        out.extend_from_slice(&self.time.to_le_bytes());
        out.extend_from_slice(&self.tag.to_le_bytes());
        out.extend_from_slice(&self.version);
    }

    fn decode(bytes: &[u8], width: usize) -> Option<Self> {
        if bytes.len() != Self::encoded_len(width) || bytes[0] > 1 {
            return None;
        }
        Some(Self {
            deleted: bytes[0] == 1,
            time: i64::from_le_bytes(bytes[1..9].try_into().ok()?),
            tag: u64::from_le_bytes(bytes[9..17].try_into().ok()?),
            version: bytes[17..].to_vec(),
        })
    }
}

/// A stored value: the entry, and the one it replaced when a run that has not been marked
/// applied wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stored {
    entry: Entry,
    replaced: Option<Entry>,
}

impl Stored {
    fn decode(bytes: &[u8], width: usize) -> Option<Self> {
        let one = Entry::encoded_len(width);
        if bytes.len() == one {
            Some(Self {
                entry: Entry::decode(bytes, width)?,
                replaced: None,
            })
        } else if bytes.len() == 2 * one {
            Some(Self {
                entry: Entry::decode(&bytes[..one], width)?,
                replaced: Some(Entry::decode(&bytes[one..], width)?),
            })
        } else {
            None
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 * Entry::encoded_len(self.entry.version.len()));
        self.entry.encode_into(&mut out);
        if let Some(replaced) = &self.replaced {
            replaced.encode_into(&mut out);
        }
        out
    }
}

/// Decides which of a run's winning rows leave the run, recording them on the server as it
/// goes; marks the batch applied after the output.
pub(crate) struct RedisState {
    server: Arc<Server>,
    compare_and_set: Script,
    options: StateOptions,
    spec: DedupSpec,
    layouts: Layouts,
    width: usize,
    fingerprint: String,
    /// This run's mark on the entries it writes.
    tag: u64,
    /// The watermark of the committed runs: entries older than it are gone.
    committed_watermark: Option<i64>,
    max_event_time_us: Option<i64>,
    /// This run's watermark: unseen rows older than it are late.
    watermark_us: Option<i64>,
    report: StateReport,
    winners: Winners,
    /// Key hashes of the entries this run wrote, to put back if it fails.
    recorded: Vec<u128>,
}

/// One winner's write.
struct Write {
    row: usize,
    read: Option<Vec<u8>>,
    value: Option<Stored>,
}

impl WinnerFilter for RedisState {
    fn expect(&mut self, rows: u64) -> Result<()> {
        self.recorded
            .reserve(usize::try_from(rows).unwrap_or(0).min(1 << 24));
        Ok(())
    }

    fn filter(&mut self, batch: RecordBatch, path: &Path) -> Result<RecordBatch> {
        let mut winners = std::mem::take(&mut self.winners);
        let kept = winners
            .read(
                &batch,
                path,
                &self.spec,
                &self.layouts,
                &self.options.time_column,
            )
            .and_then(|()| self.decide(&winners, path));
        self.winners = winners;
        filter_record_batch(&batch, &BooleanArray::from(kept?)).map_err(Error::arrow(path))
    }
}

impl RedisState {
    /// Whether each winner leaves the run; records the decisions on the server.
    ///
    /// Most keys of a run are new to the state, so each winner is first judged as if its
    /// key were absent and claimed with `SET … NX GET` (pipelined, a chunk in flight while
    /// the next is judged): the server sets the entry only if the key is absent, and
    /// otherwise returns what it holds. A key the server holds is then decided again on
    /// that, and written by compare-and-set. A row that would be late if its key were
    /// absent is read first.
    fn decide(&mut self, winners: &Winners, path: &Path) -> Result<Vec<bool>> {
        let n = winners.len();
        let mut verdicts = vec![Verdict::SeenBefore; n];
        let mut held: Vec<(usize, Option<Vec<u8>>)> = Vec::new();
        let mut unread: Vec<usize> = Vec::new();
        let mut claims = Vec::new();
        let mut start = 0;
        while start < n {
            let range = start..(start + CHUNK).min(n);
            start = range.end;
            let mut pipeline = redis::pipe();
            let mut claimed = Vec::new();
            let mut minutes: std::collections::BTreeMap<i64, i64> = Default::default();
            for row in range {
                let (verdict, write) = self.judge_row(winners, row, None, path)?;
                verdicts[row] = verdict;
                let Some(Write {
                    value: Some(stored),
                    ..
                }) = write
                else {
                    // Not recorded if its key is absent: whether it is, decides.
                    unread.push(row);
                    continue;
                };
                let at = self.expires_at(&stored.entry);
                pipeline
                    .cmd("SET")
                    .arg(self.server.entry_key(winners.hashes[row]))
                    .arg(stored.encode())
                    .arg("NX")
                    .arg("GET")
                    .arg("PXAT")
                    .arg(at);
                claimed.push((row, at.div_euclid(MINUTE_MS)));
                *minutes.entry(at.div_euclid(MINUTE_MS)).or_default() += 1;
            }
            self.server.count_expiries(&mut pipeline, &minutes);
            if !claimed.is_empty() {
                claims.push((claimed, self.server.send_pipeline(pipeline)));
            }
        }
        for (claimed, sent) in claims {
            let replies = self.server.wait(sent)?;
            if replies.len() != claimed.len() {
                return Err(self.unexpected("claims"));
            }
            let mut lost: std::collections::BTreeMap<i64, i64> = Default::default();
            for ((row, minute), reply) in claimed.into_iter().zip(replies) {
                match reply {
                    Value::Nil => self.recorded.push(winners.hashes[row]),
                    Value::BulkString(value) => {
                        // The server holds the key: nothing was set.
                        held.push((row, Some(value)));
                        *lost.entry(minute).or_default() -= 1;
                    }
                    _ => return Err(self.unexpected("claim")),
                }
            }
            if !lost.is_empty() {
                let mut pipeline = redis::pipe();
                self.server.count_expiries(&mut pipeline, &lost);
                let sent = self.server.send_pipeline(pipeline);
                self.server.wait(sent)?;
            }
        }
        for rows in unread.chunks(CHUNK) {
            let keys: Vec<Vec<u8>> = rows
                .iter()
                .map(|&row| self.server.entry_key(winners.hashes[row]))
                .collect();
            let values: Vec<Option<Vec<u8>>> = self.server.query(redis::cmd("MGET").arg(keys))?;
            held.extend(
                rows.iter()
                    .zip(values)
                    .filter(|(_, value)| value.is_some())
                    .map(|(&row, value)| (row, value)),
            );
        }
        held.sort_unstable_by_key(|(row, _)| *row);
        for rows in held.chunks_mut(CHUNK) {
            let decided = self.decide_held(winners, rows, path)?;
            for ((row, _), verdict) in rows.iter().zip(decided) {
                verdicts[*row] = verdict;
            }
        }
        let mut emit = Vec::with_capacity(n);
        for (row, verdict) in verdicts.into_iter().enumerate() {
            let time = winners.times[row];
            let watermark = self.watermark_us;
            emit.push(self.report.count(verdict, self.options.late, || {
                late_error(path, time, watermark)
            })?);
        }
        Ok(emit)
    }

    /// The verdicts of the winners `rows` (each with the value read for it, `None` where it
    /// must be read again), written by compare-and-set until no other run changed them.
    fn decide_held(
        &mut self,
        winners: &Winners,
        rows: &mut [(usize, Option<Vec<u8>>)],
        path: &Path,
    ) -> Result<Vec<Verdict>> {
        let keys: Vec<Vec<u8>> = rows
            .iter()
            .map(|(row, _)| self.server.entry_key(winners.hashes[*row]))
            .collect();
        let hashes: Vec<u128> = rows.iter().map(|(row, _)| winners.hashes[*row]).collect();
        let mut verdicts = vec![Verdict::SeenBefore; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        for _ in 0..MAX_ROUNDS {
            let mut writes = Vec::new();
            for &at in &pending {
                let (row, read) = &mut rows[at];
                let (verdict, write) = self.judge_row(winners, *row, read.take(), path)?;
                verdicts[at] = verdict;
                if let Some(write) = write {
                    writes.push(Write { row: at, ..write });
                }
            }
            let conflicts = self.write(&keys, &writes, &hashes)?;
            if conflicts.is_empty() {
                return Ok(verdicts);
            }
            pending = conflicts.iter().map(|(at, _)| *at).collect();
            for (at, value) in conflicts {
                rows[at].1 = value;
            }
        }
        Err(Error::Redis {
            target: self.server.display.clone(),
            message: format!(
                "{} keys of {} kept changing under concurrent runs; nothing of this run's \
                 output was written",
                pending.len(),
                path.display()
            ),
        })
    }

    /// When an entry expires on the server's clock: its event time + the horizon (PXAT
    /// takes a positive time; one in the past deletes the entry at once).
    fn expires_at(&self, entry: &Entry) -> i64 {
        let horizon_ms = self.options.horizon_us() / 1000;
        entry
            .time
            .div_euclid(1000)
            .saturating_add(horizon_ms)
            .max(1)
    }

    /// The verdict for winner `row` given the stored value `read`, and what to write.
    fn judge_row(
        &self,
        winners: &Winners,
        row: usize,
        read: Option<Vec<u8>>,
        path: &Path,
    ) -> Result<(Verdict, Option<Write>)> {
        let stored = match &read {
            Some(bytes) => Some(
                Stored::decode(bytes, self.width).ok_or_else(|| Error::Redis {
                    target: self.server.display.clone(),
                    message: format!(
                        "an entry under prefix '{}' is not an idem state entry of {}-byte \
                     versions (reading {})",
                        self.server.prefix,
                        self.width,
                        path.display()
                    ),
                })?,
            ),
            None => None,
        };
        // Under this run's own tag, an earlier attempt of this run wrote the entry: the run
        // judges what that attempt replaced.
        let ours = stored.as_ref().is_some_and(|s| s.entry.tag == self.tag);
        let before: Option<Entry> = match stored {
            Some(s) if ours => s.replaced,
            Some(s) => Some(s.entry),
            None => None,
        };
        let live = before
            .as_ref()
            .filter(|e| self.committed_watermark.is_none_or(|w| e.time >= w));
        let known = live.map(|e| Known {
            version: &e.version,
            deleted: e.deleted,
            time: e.time,
        });
        let version = winners.version(row);
        let is_delete = winners.tombstones[row];
        let time = winners.times[row];
        let verdict = judge(known, version, is_delete, time, self.watermark_us);
        let value = if verdict.records() {
            Some(Stored {
                entry: Entry {
                    deleted: is_delete,
                    time: Verdict::event_time(known, time),
                    tag: self.tag,
                    version: version.to_vec(),
                },
                replaced: before,
            })
        } else if ours {
            // An earlier attempt recorded what this one does not (the committed watermark
            // moved in between): put back what it replaced.
            before.map(|entry| Stored {
                entry,
                replaced: None,
            })
        } else {
            return Ok((verdict, None));
        };
        if value.is_none() && read.is_none() {
            return Ok((verdict, None));
        }
        Ok((
            verdict,
            Some(Write {
                row: 0,
                read,
                value,
            }),
        ))
    }

    /// Writes `writes` (indices into `keys` and their key `hashes`) with one
    /// compare-and-set; returns the entries that changed since they were read, with their
    /// current values.
    fn write(
        &mut self,
        keys: &[Vec<u8>],
        writes: &[Write],
        hashes: &[u128],
    ) -> Result<Vec<(usize, Option<Vec<u8>>)>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let expiry = |entry: &Entry| self.expires_at(entry);
        let mut call_keys = Vec::with_capacity(writes.len() + 1);
        call_keys.push(self.server.key("expiry").into_bytes());
        let mut args = Vec::with_capacity(writes.len() * 5);
        for write in writes {
            call_keys.push(keys[write.row].clone());
            let old_minute = write
                .read
                .as_deref()
                .and_then(|bytes| Stored::decode(bytes, self.width))
                .map_or(0, |s| expiry(&s.entry).div_euclid(MINUTE_MS));
            let (value, at) = match &write.value {
                Some(stored) => (stored.encode(), expiry(&stored.entry)),
                None => (Vec::new(), 0),
            };
            args.push(write.read.clone().unwrap_or_default());
            args.push(value);
            args.push(at.to_string().into_bytes());
            args.push(old_minute.to_string().into_bytes());
            args.push(at.div_euclid(MINUTE_MS).to_string().into_bytes());
        }
        let reply: Vec<Value> = self
            .server
            .invoke(&self.compare_and_set, &call_keys, &args)?;
        let mut conflicts = Vec::new();
        let mut changed = vec![false; writes.len()];
        for pair in reply.chunks(2) {
            let (Some(Value::Int(index)), Some(value)) = (pair.first(), pair.get(1)) else {
                return Err(self.unexpected("compare-and-set"));
            };
            let write_at = usize::try_from(*index - 1).map_err(|_| self.unexpected("index"))?;
            let write = writes
                .get(write_at)
                .ok_or_else(|| self.unexpected("index"))?;
            changed[write_at] = true;
            let value = match value {
                Value::BulkString(bytes) if bytes.is_empty() => None,
                Value::BulkString(bytes) => Some(bytes.clone()),
                _ => return Err(self.unexpected("value")),
            };
            conflicts.push((write.row, value));
        }
        for (write, changed) in writes.iter().zip(changed) {
            if !changed
                && write
                    .value
                    .as_ref()
                    .is_some_and(|s| s.entry.tag == self.tag)
            {
                self.recorded.extend(hashes.get(write.row));
            }
        }
        Ok(conflicts)
    }

    fn unexpected(&self, what: &str) -> Error {
        Error::Redis {
            target: self.server.display.clone(),
            message: format!("unexpected reply of the state's script ({what})"),
        }
    }

    /// Every winner is decided and recorded; the batch is marked applied after the output.
    pub(crate) fn stage(self: Box<Self>) -> StagedRedis {
        StagedRedis { state: self }
    }

    /// Puts back the entries this run replaced, where they still hold what it wrote. Best
    /// effort: what it cannot put back, a re-run of the batch finds under its tag.
    pub(crate) fn abandon(mut self) {
        let recorded = std::mem::take(&mut self.recorded);
        for hashes in recorded.chunks(CHUNK) {
            let keys: Vec<Vec<u8>> = hashes.iter().map(|&h| self.server.entry_key(h)).collect();
            let Ok(current) = self
                .server
                .query::<Vec<Option<Vec<u8>>>>(redis::cmd("MGET").arg(&keys))
            else {
                return;
            };
            let writes: Vec<Write> = current
                .into_iter()
                .enumerate()
                .filter_map(|(at, read)| {
                    let stored = Stored::decode(read.as_deref()?, self.width)?;
                    (stored.entry.tag == self.tag).then(|| Write {
                        row: at,
                        read,
                        value: stored.replaced.map(|entry| Stored {
                            entry,
                            replaced: None,
                        }),
                    })
                })
                .collect();
            if self.write(&keys, &writes, hashes).is_err() {
                return;
            }
        }
    }
}

/// A run whose entries are written, waiting for its output to commit.
pub(crate) struct StagedRedis {
    state: Box<RedisState>,
}

impl StagedRedis {
    /// Marks the batch applied and advances the state's clock, in one step on the server.
    ///
    /// # Errors
    /// The server fails (the output stands; a re-run of the batch records it).
    pub(crate) fn commit(self, _output: &str) -> Result<StateReport> {
        let state = self.state;
        let server = &state.server;
        let optional = |v: Option<i64>| v.map_or_else(Vec::new, |v| v.to_string().into_bytes());
        let keys = [
            server.key("runs").into_bytes(),
            server.key("clock").into_bytes(),
            server.key("expiry").into_bytes(),
        ];
        let args = [
            state.fingerprint.clone().into_bytes(),
            now_millis().to_string().into_bytes(),
            optional(state.max_event_time_us),
            optional(state.watermark_us),
            REMEMBERED_RUNS.to_string().into_bytes(),
        ];
        let reply: Vec<i64> = server.invoke(&Script::new(COMMIT), &keys, &args)?;
        let [_, version, expired, live] = reply[..] else {
            return Err(state.unexpected("commit"));
        };
        let mut report = state.report.clone();
        report.version = version.max(0) as u64;
        report.expired = expired.max(0) as u64;
        report.keys = live.max(0) as u64;
        report.max_event_time = state.max_event_time_us.map(rfc3339);
        report.watermark = state.watermark_us.map(rfc3339);
        // What an entry costs the server, from a sample of this run's.
        let sample: Vec<i64> = state
            .recorded
            .iter()
            .take(16)
            .filter_map(|&hash| {
                server
                    .query::<Option<i64>>(
                        redis::cmd("MEMORY")
                            .arg("USAGE")
                            .arg(server.entry_key(hash))
                            .arg("SAMPLES")
                            .arg(0),
                    )
                    .ok()
                    .flatten()
            })
            .collect();
        if !sample.is_empty() {
            report.bytes_per_key = sample.iter().sum::<i64>() as f64 / sample.len() as f64;
            report.bytes = (report.bytes_per_key * report.keys as f64) as u64;
        }
        Ok(report)
    }

    /// The output's commit failed.
    pub(crate) fn abandon(self) {
        self.state.abandon();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_with_and_without_what_they_replaced() {
        let entry = |deleted, time, tag, version: &[u8]| Entry {
            deleted,
            time,
            tag,
            version: version.to_vec(),
        };
        for stored in [
            Stored {
                entry: entry(false, -5, 7, &[1, 2]),
                replaced: None,
            },
            Stored {
                entry: entry(true, 1 << 50, u64::MAX, &[0, 0]),
                replaced: Some(entry(false, 3, 1, &[9, 9])),
            },
        ] {
            assert_eq!(Stored::decode(&stored.encode(), 2), Some(stored.clone()));
            // Another layout's entries are told apart by their length.
            assert_eq!(Stored::decode(&stored.encode(), 3), None);
        }
        assert_eq!(Stored::decode(&[2; 19], 2), None);
        assert_eq!(Stored::decode(b"", 0), None);
    }
}
