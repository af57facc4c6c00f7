//! A seeded generator of realistic CDC / event data, for the sample data, tests and
//! benchmarks: the same options always give byte-identical files.
//!
//! The model: a source emits *true* events in LSN order — creates of new keys, updates and
//! deletes of live ones — and an at-least-once pipeline delivers them: some are replayed
//! later as exact duplicates, some are delayed so that an older version arrives after a
//! newer one. Keys are `(event_id, sequence)`: an entity (UUID) has one or more sequences.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    ArrayRef, Decimal128Builder, Int64Builder, RecordBatch, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use idem_core::rng::SplitMix64;

use crate::error::{Error, Result};
use crate::storage::{Location, StorageOptions};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Rows delivered in total (replays included).
    pub rows: u64,
    /// Files to spread them over, in delivery order.
    pub files: usize,
    /// Seed of the generator.
    pub seed: u64,
    /// Probability that a delivered event is replayed again later.
    pub duplicate_rate: f64,
    /// Probability that a true event updates a live key rather than creating one.
    pub update_rate: f64,
    /// Probability that a true event deletes a live key.
    pub delete_rate: f64,
    /// Probability that a delivery is delayed (so it may arrive after newer versions).
    pub reorder_rate: f64,
    /// Approximate bytes of the `payload` column.
    pub payload_bytes: usize,
    /// Extra attribute columns `attr_000`, `attr_001`, … after `payload` (alternately
    /// integers and short text), for wide-table shapes. A replay repeats its values.
    pub extra_columns: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            rows: 1_000_000,
            files: 4,
            seed: 42,
            duplicate_rate: 0.15,
            update_rate: 0.15,
            delete_rate: 0.01,
            reorder_rate: 0.05,
            payload_bytes: 100,
            extra_columns: 0,
        }
    }
}

/// The schema of generated events with `extra_columns` attribute columns.
pub fn event_schema(extra_columns: usize) -> SchemaRef {
    let mut fields = vec![
        Field::new("event_id", DataType::Utf8, false),
        Field::new("sequence", DataType::Int64, false),
        Field::new("lsn", DataType::Int64, false),
        Field::new("op", DataType::Utf8, false),
        Field::new(
            "event_time",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
        Field::new("customer_id", DataType::Int64, false),
        Field::new("amount", DataType::Decimal128(12, 2), false),
        Field::new("status", DataType::Utf8, false),
        Field::new("payload", DataType::Utf8, true),
    ];
    fields.extend((0..extra_columns).map(|i| {
        let data_type = if i % 2 == 0 {
            DataType::Int64
        } else {
            DataType::Utf8
        };
        Field::new(format!("attr_{i:03}"), data_type, true)
    }));
    Arc::new(Schema::new(fields))
}

/// An extra column's builder.
enum Extra {
    Int(Int64Builder),
    Text(StringBuilder),
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Event {
    entity: u64,
    sequence: i64,
    lsn: i64,
    op: u8,
    micros: i64,
    amount: i64,
    status: u8,
    payload_seed: u64,
}

const STATUSES: [&str; 6] = [
    "pending",
    "paid",
    "shipped",
    "delivered",
    "cancelled",
    "refunded",
];
const WORDS: [&str; 16] = [
    "alpha", "bravo", "cart", "delta", "echo", "fox", "gold", "hotel", "india", "jade", "kilo",
    "lima", "mango", "north", "oscar", "papa",
];
/// 2026-01-01T00:00:00Z in microseconds.
const EPOCH_MICROS: i64 = 1_767_225_600_000_000;

fn uuid(seed: u64, entity: u64, out: &mut String) {
    let mut rng = SplitMix64::new(seed ^ entity.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let hi = rng.next_u64();
    let lo = rng.next_u64();
    // Version 4, variant 1, as random UUIDs are.
    let hi = (hi & 0xffff_ffff_ffff_0fff) | 0x4000;
    let lo = (lo & 0x3fff_ffff_ffff_ffff) | 0x8000_0000_0000_0000;
    use std::fmt::Write;
    let _ = write!(
        out,
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xffff,
        hi & 0xffff,
        lo >> 48,
        lo & 0xffff_ffff_ffff
    );
}

fn payload(seed: u64, bytes: usize, out: &mut String) {
    use std::fmt::Write;
    let mut rng = SplitMix64::new(seed);
    let _ = write!(
        out,
        "{{\"session\":\"{:016x}\",\"page\":\"/p/{}\",\"note\":\"",
        rng.next_u64(),
        rng.below(5000)
    );
    while out.len() + 2 < bytes {
        out.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        out.push(' ');
    }
    out.push_str("\"}");
}

/// Generated files and what they hold.
#[derive(Debug, Clone)]
pub struct Generated {
    /// The files written, in delivery order.
    pub files: Vec<PathBuf>,
    /// Rows written.
    pub rows: u64,
}

struct Batcher {
    schema: SchemaRef,
    seed: u64,
    payload_bytes: usize,
    event_id: StringBuilder,
    sequence: Int64Builder,
    lsn: Int64Builder,
    op: StringBuilder,
    event_time: TimestampMicrosecondBuilder,
    customer: Int64Builder,
    amount: Decimal128Builder,
    status: StringBuilder,
    payload: StringBuilder,
    extra: Vec<Extra>,
    len: usize,
    scratch: String,
}

impl Batcher {
    fn new(schema: SchemaRef, seed: u64, payload_bytes: usize) -> Self {
        // The fixed event columns come first; every further field is an extra column.
        let extra_columns = schema
            .fields()
            .len()
            .saturating_sub(event_schema(0).fields().len());
        Self {
            schema,
            seed,
            payload_bytes,
            event_id: StringBuilder::new(),
            sequence: Int64Builder::new(),
            lsn: Int64Builder::new(),
            op: StringBuilder::new(),
            event_time: TimestampMicrosecondBuilder::new().with_timezone("UTC"),
            customer: Int64Builder::new(),
            amount: Decimal128Builder::new(),
            status: StringBuilder::new(),
            payload: StringBuilder::new(),
            extra: (0..extra_columns)
                .map(|i| {
                    if i % 2 == 0 {
                        Extra::Int(Int64Builder::new())
                    } else {
                        Extra::Text(StringBuilder::new())
                    }
                })
                .collect(),
            len: 0,
            scratch: String::new(),
        }
    }

    fn push(&mut self, e: &Event) {
        self.scratch.clear();
        uuid(self.seed, e.entity, &mut self.scratch);
        self.event_id.append_value(&self.scratch);
        self.sequence.append_value(e.sequence);
        self.lsn.append_value(e.lsn);
        self.op.append_value(match e.op {
            b'c' => "c",
            b'u' => "u",
            _ => "d",
        });
        self.event_time.append_value(e.micros);
        self.customer
            .append_value((e.entity.wrapping_mul(0x9e37_79b9) % 100_000) as i64);
        self.amount.append_value(i128::from(e.amount));
        self.status.append_value(STATUSES[e.status as usize]);
        self.scratch.clear();
        payload(e.payload_seed, self.payload_bytes, &mut self.scratch);
        self.payload.append_value(&self.scratch);
        let mut rng = SplitMix64::new(e.payload_seed ^ 0x5eed);
        for extra in &mut self.extra {
            let value = rng.next_u64();
            match extra {
                Extra::Int(b) => b.append_value((value % 1_000_000) as i64),
                Extra::Text(b) => {
                    let word = WORDS[(value % WORDS.len() as u64) as usize];
                    b.append_value(format!("{word}-{}", (value >> 8) % 10_000));
                }
            }
        }
        self.len += 1;
    }

    fn finish(&mut self) -> Result<RecordBatch> {
        let mut columns: Vec<ArrayRef> = vec![
            Arc::new(self.event_id.finish()),
            Arc::new(self.sequence.finish()),
            Arc::new(self.lsn.finish()),
            Arc::new(self.op.finish()),
            Arc::new(self.event_time.finish()),
            Arc::new(self.customer.finish()),
            Arc::new(
                self.amount
                    .finish()
                    .with_precision_and_scale(12, 2)
                    .map_err(|e| Error::InvalidArgument(e.to_string()))?,
            ),
            Arc::new(self.status.finish()),
            Arc::new(self.payload.finish()),
        ];
        columns.extend(self.extra.iter_mut().map(|extra| -> ArrayRef {
            match extra {
                Extra::Int(b) => Arc::new(b.finish()),
                Extra::Text(b) => Arc::new(b.finish()),
            }
        }));
        self.len = 0;
        RecordBatch::try_new(Arc::clone(&self.schema), columns)
            .map_err(|e| Error::InvalidArgument(e.to_string()))
    }
}

/// [`generate`] into a local directory or an object-store prefix (`s3://bucket/events`):
/// remote files are written locally first and each uploaded whole.
///
/// # Errors
/// As [`generate`], or a store that refuses the uploads.
pub fn generate_to(
    options: &GenerateOptions,
    target: &str,
    storage: &StorageOptions,
) -> Result<Generated> {
    let remote = match Location::parse(target, storage)? {
        Location::Local(dir) => return generate(options, &dir),
        Location::Remote(remote) => remote,
    };
    let staging = tempfile::Builder::new()
        .prefix("idem-generate-")
        .tempdir()
        .map_err(Error::io(std::env::temp_dir()))?;
    let local = generate(options, staging.path())?;
    let mut files = Vec::with_capacity(local.files.len());
    for file in &local.files {
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| Error::InvalidArgument(format!("{}: bad file name", file.display())))?;
        let object = remote.join(name);
        object.upload(file)?;
        files.push(object.display_path());
    }
    Ok(Generated {
        files,
        rows: local.rows,
    })
}

/// Writes `options.rows` generated events into `options.files` Parquet files in `dir`
/// (`events-00000.parquet`, …), creating `dir` if needed.
///
/// # Errors
/// The directory or a file cannot be written.
pub fn generate(options: &GenerateOptions, dir: &Path) -> Result<Generated> {
    std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    let schema = event_schema(options.extra_columns);
    let mut rng = SplitMix64::new(options.seed);
    let files = options.files.max(1);
    let per_file = options.rows.div_ceil(files as u64).max(1);
    let batch_rows = 65_536usize;

    // Live keys: (entity, sequence, last amount), sampled for updates and deletes.
    let mut live: Vec<(u64, i64)> = Vec::new();
    let mut next_entity = 0u64;
    let mut pending: BinaryHeap<Reverse<(u64, u64, Event)>> = BinaryHeap::new();
    let mut tick = 0u64;
    let mut lsn = 1_000i64;
    let mut delivered = 0u64;
    let mut written = Vec::new();
    let mut batcher = Batcher::new(Arc::clone(&schema), options.seed, options.payload_bytes);
    let mut writer: Option<(PathBuf, ArrowWriter<std::fs::File>)> = None;
    let properties = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .build();

    while delivered < options.rows {
        // One true event.
        let roll = rng.unit();
        let event = if live.is_empty() || roll >= options.update_rate + options.delete_rate {
            // A new key: usually a new entity, sometimes the next sequence of a recent one.
            let (entity, sequence) = match live.last() {
                Some(&(entity, sequence)) if rng.unit() < 0.3 => (entity, sequence + 1),
                _ => {
                    next_entity += 1;
                    (next_entity, 0)
                }
            };
            live.push((entity, sequence));
            (entity, sequence, b'c')
        } else {
            // Recent keys are the likeliest to change.
            let window = live.len().min(10_000) as u64;
            let index = live.len() - 1 - rng.below(window) as usize;
            let (entity, sequence) = live[index];
            if roll < options.update_rate {
                (entity, sequence, b'u')
            } else {
                live.swap_remove(index);
                (entity, sequence, b'd')
            }
        };
        lsn += 1 + rng.below(16) as i64;
        let e = Event {
            entity: event.0,
            sequence: event.1,
            lsn,
            op: event.2,
            micros: EPOCH_MICROS + tick as i64 * 10_000 + rng.below(10_000) as i64,
            amount: rng.below(1_000_000) as i64,
            status: if event.2 == b'd' {
                4
            } else {
                rng.below(4) as u8
            },
            payload_seed: rng.next_u64(),
        };
        let delay = if rng.unit() < options.reorder_rate {
            1 + rng.below(2_000)
        } else {
            0
        };
        pending.push(Reverse((tick + delay, tick, e.clone())));
        if rng.unit() < options.duplicate_rate {
            pending.push(Reverse((tick + 1 + rng.below(5_000), tick, e)));
        }
        tick += 1;

        // Deliver what is due (everything, once the source has produced enough).
        while let Some(Reverse((due, _, _))) = pending.peek() {
            if *due > tick && (pending.len() as u64) < options.rows.saturating_sub(delivered) {
                break;
            }
            let Some(Reverse((_, _, event))) = pending.pop() else {
                break;
            };
            if delivered >= options.rows {
                break;
            }
            if writer.is_none() {
                let path = dir.join(format!("events-{:05}.parquet", written.len()));
                let file = std::fs::File::create(&path).map_err(Error::io(&path))?;
                let w = ArrowWriter::try_new(file, Arc::clone(&schema), Some(properties.clone()))
                    .map_err(Error::parquet(&path))?;
                written.push(path.clone());
                writer = Some((path, w));
            }
            batcher.push(&event);
            delivered += 1;
            let file_full = delivered.is_multiple_of(per_file) || delivered == options.rows;
            if batcher.len == batch_rows || file_full {
                let batch = batcher.finish()?;
                if let Some((path, w)) = writer.as_mut() {
                    w.write(&batch).map_err(Error::parquet(path.clone()))?;
                }
            }
            if file_full && let Some((path, w)) = writer.take() {
                w.close().map_err(Error::parquet(path))?;
            }
        }
    }
    Ok(Generated {
        files: written,
        rows: delivered,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_look_like_uuids() {
        let mut s = String::new();
        uuid(1, 2, &mut s);
        assert_eq!(s.len(), 36);
        assert_eq!(&s[14..15], "4");
        assert_eq!(s.matches('-').count(), 4);
    }

    #[test]
    fn same_options_same_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = GenerateOptions {
            rows: 5_000,
            files: 2,
            ..GenerateOptions::default()
        };
        let a = generate(&options, &dir.path().join("a")).expect("a");
        let b = generate(&options, &dir.path().join("b")).expect("b");
        assert_eq!(a.rows, 5_000);
        assert_eq!(a.files.len(), 2);
        for (x, y) in a.files.iter().zip(&b.files) {
            assert_eq!(std::fs::read(x).expect("x"), std::fs::read(y).expect("y"));
        }
    }
}
