//! `idem dedup --report PATH.html`: one self-contained page for operators — the run's
//! counts, the duplicate rate over event time (per second, minute, hour or day: the finest
//! that keeps the chart readable), each input file's dropped share, and the keys delivered
//! most often.
//!
//! The page is static HTML with an inline SVG chart: no script, no network, nothing to
//! load, so it opens anywhere (a CI artifact, an e-mail attachment) exactly as written.
//!
//! Its figures come from one extra read of the key and time columns: a row is a copy when
//! its key was seen before it in input order, which is what `duplicates + superseded`
//! counts over the whole run; a copy is charted at its own event time. Counting keeps one
//! 64-bit key hash and a counter per distinct key; the keys shown are found by a second
//! read of the key columns, stopping once all are found.

use std::collections::{BinaryHeap, HashMap};
use std::fmt::Write as _;
use std::path::Path;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{TimeUnit, TimestampSecondType};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use idem_core::RowHasher;

use crate::dedup::{DedupJob, DedupReport};
use crate::error::{Error, Result};
use crate::read::event_time::{check_time_column, event_times};
use crate::read::expand::expand_inputs;
use crate::read::input::InputFile;

/// What to put in a report beyond the run's statistics.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// The event-time column to chart the duplicate rate over; no chart without one.
    pub time_column: Option<String>,
    /// How many of the most-delivered keys to list.
    pub top_keys: usize,
}

/// Bucket widths the chart may use, in seconds: a second, a minute, an hour, a day.
const STEPS: [i64; 4] = [1, 60, 3600, 86_400];
/// Most bars in the chart: the finest step that keeps the span within this many is used.
const MAX_BARS: i64 = 240;
/// Most buckets held while reading; beyond it they are merged into the next wider step.
const MAX_HELD_BUCKETS: usize = 50_000;

/// Rows and copies in one time bucket.
#[derive(Debug, Default, Clone, Copy)]
struct Bucket {
    rows: u64,
    copies: u64,
}

/// What the extra read found.
struct Observed {
    /// Per bucket of `step` seconds (keyed by the bucket's start, seconds since the epoch).
    times: HashMap<i64, Bucket>,
    step: i64,
    /// Rows whose time is null.
    untimed: Bucket,
    /// Keys delivered more than once: (copies received, key hash), most first.
    top: Vec<(u32, u64)>,
}

/// Checks, before a dedup runs, that its report can be made: every input has the time
/// column, as a timestamp or date. A typo should not cost a whole run.
///
/// # Errors
/// An input without the column, or with it in another type, named with the file.
pub fn check_report(job: &DedupJob, options: &ReportOptions) -> Result<()> {
    let Some(column) = &options.time_column else {
        return Ok(());
    };
    for source in expand_inputs(&job.inputs, &job.storage)? {
        check_time_column(&InputFile::open(&source)?, column)?;
    }
    Ok(())
}

/// Writes the report of a finished dedup run to `path` (replaced atomically).
///
/// # Errors
/// An input that can no longer be read, a time column that is missing or not a date or
/// timestamp, or a page that cannot be written.
pub fn write_report(
    path: &Path,
    job: &DedupJob,
    report: &DedupReport,
    options: &ReportOptions,
) -> Result<()> {
    let files: Vec<InputFile> = expand_inputs(&job.inputs, &job.storage)?
        .iter()
        .map(InputFile::open)
        .collect::<Result<_>>()?;
    let observed = observe(&files, &job.spec.keys, options)?;
    let wanted: Vec<u64> = observed.top.iter().map(|&(_, hash)| hash).collect();
    let shown = describe_keys(&files, &job.spec.keys, &wanted)?;
    let page = render(report, options, &observed, &shown);
    crate::write::publish::replace_file(path, &page, "--report")
}

/// The key hash of every row, `None` where a key column is null (such rows have no key).
fn key_hashes(batch: &RecordBatch, keys: &[String], path: &Path) -> Result<Vec<Option<u64>>> {
    let hasher = RowHasher::try_new(batch.schema().as_ref(), keys).map_err(Error::arrow(path))?;
    let hashes = hasher.hash(batch).map_err(Error::arrow(path))?;
    let columns: Vec<&dyn Array> = keys
        .iter()
        .filter_map(|k| batch.column_by_name(k).map(AsRef::as_ref))
        .collect();
    Ok(hashes
        .into_iter()
        .enumerate()
        .map(|(row, hash)| (!columns.iter().any(|c| c.is_null(row))).then_some(hash as u64))
        .collect())
}

fn observe(files: &[InputFile], keys: &[String], options: &ReportOptions) -> Result<Observed> {
    // Key hashes are XXH3 already: the table uses them as they are, no second hash.
    let mut seen: HashTable<(u64, u32)> = HashTable::new();
    let mut times: HashMap<i64, Bucket> = HashMap::new();
    let mut step = STEPS[0];
    let mut untimed = Bucket::default();
    let (mut current, mut run): (Option<i64>, Bucket) = (None, Bucket::default());
    for file in files {
        let mut columns: Vec<&str> = keys.iter().map(String::as_str).collect();
        if let Some(time) = &options.time_column {
            if file.schema().field_with_name(time).is_err() {
                return Err(Error::MissingRequiredColumn {
                    path: file.path().to_path_buf(),
                    column: time.clone(),
                });
            }
            columns.push(time);
        }
        for batch in file.read_columns(&columns)? {
            let batch = batch?;
            let seconds = match &options.time_column {
                Some(time) => Some(event_seconds(&batch, time, file.path())?),
                None => None,
            };
            for (row, hash) in key_hashes(&batch, keys, file.path())?
                .into_iter()
                .enumerate()
            {
                let Some(hash) = hash else { continue };
                let copy = match seen.entry(hash, |&(h, _)| h == hash, |&(h, _)| h) {
                    Entry::Occupied(mut seen_before) => {
                        let count = &mut seen_before.get_mut().1;
                        *count = count.saturating_add(1);
                        true
                    }
                    Entry::Vacant(new) => {
                        new.insert((hash, 1));
                        false
                    }
                };
                let start = match &seconds {
                    Some(s) if s.is_valid(row) => {
                        Some(s.value(row) - s.value(row).rem_euclid(step))
                    }
                    _ => None,
                };
                // Event times cluster: rows are added up per run of one bucket, and the
                // map is touched once per run rather than once per row.
                if start != current {
                    add_to(&mut times, &mut untimed, current, run);
                    current = start;
                    run = Bucket::default();
                }
                run.rows += 1;
                run.copies += u64::from(copy);
            }
            add_to(&mut times, &mut untimed, current, run);
            run = Bucket::default();
            if times.len() > MAX_HELD_BUCKETS
                && let Some(&wider) = STEPS.iter().find(|&&s| s > step)
            {
                times = rebucket(&times, wider);
                step = wider;
            }
        }
    }
    // The most-delivered keys: a bounded min-heap over the counts.
    let mut heap: BinaryHeap<std::cmp::Reverse<(u32, u64)>> = BinaryHeap::new();
    for &(hash, count) in &seen {
        if count < 2 {
            continue;
        }
        heap.push(std::cmp::Reverse((count, hash)));
        if heap.len() > options.top_keys {
            heap.pop();
        }
    }
    let mut top: Vec<(u32, u64)> = heap.into_iter().map(|r| r.0).collect();
    top.sort_by(|a, b| b.cmp(a));
    Ok(Observed {
        times,
        step,
        untimed,
        top,
    })
}

/// Adds a run of rows to its bucket (`None`: rows without a time).
fn add_to(times: &mut HashMap<i64, Bucket>, untimed: &mut Bucket, start: Option<i64>, run: Bucket) {
    let bucket = match start {
        Some(start) => times.entry(start).or_default(),
        None => untimed,
    };
    bucket.rows += run.rows;
    bucket.copies += run.copies;
}

/// The same counts in buckets `step` seconds wide.
fn rebucket(times: &HashMap<i64, Bucket>, step: i64) -> HashMap<i64, Bucket> {
    let mut wider: HashMap<i64, Bucket> = HashMap::new();
    for (&start, bucket) in times {
        let slot = wider.entry(start - start.rem_euclid(step)).or_default();
        slot.rows += bucket.rows;
        slot.copies += bucket.copies;
    }
    wider
}

/// The time column as seconds since the epoch.
fn event_seconds(
    batch: &RecordBatch,
    column: &str,
    path: &Path,
) -> Result<arrow::array::PrimitiveArray<TimestampSecondType>> {
    let seconds = event_times(batch, column, path, TimeUnit::Second)?;
    Ok(seconds.as_primitive::<TimestampSecondType>().clone())
}

/// `column=value, …` of the first row with each wanted key hash.
fn describe_keys(
    files: &[InputFile],
    keys: &[String],
    wanted: &[u64],
) -> Result<HashMap<u64, String>> {
    let mut found: HashMap<u64, String> = HashMap::new();
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    for file in files {
        if found.len() == wanted.len() {
            break;
        }
        for batch in file.read_columns(&names)? {
            let batch = batch?;
            let hashes = key_hashes(&batch, keys, file.path())?;
            let formatters =
                keys.iter()
                    .map(|k| {
                        let column = batch.column_by_name(k).ok_or_else(|| {
                            Error::MissingRequiredColumn {
                                path: file.path().to_path_buf(),
                                column: k.clone(),
                            }
                        })?;
                        ArrayFormatter::try_new(column.as_ref(), &FormatOptions::default())
                            .map_err(Error::arrow(file.path()))
                    })
                    .collect::<Result<Vec<_>>>()?;
            for (row, hash) in hashes.into_iter().enumerate() {
                let Some(hash) = hash else { continue };
                if wanted.contains(&hash) && !found.contains_key(&hash) {
                    let text = keys
                        .iter()
                        .zip(&formatters)
                        .map(|(k, f)| format!("{k}={}", f.value(row)))
                        .collect::<Vec<_>>()
                        .join(", ");
                    found.insert(hash, text);
                }
            }
            if found.len() == wanted.len() {
                break;
            }
        }
    }
    Ok(found)
}

/// Text safe inside HTML elements and attribute values.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        "–".to_owned()
    } else {
        format!("{:.2}%", 100.0 * part as f64 / whole as f64)
    }
}

/// The chart's buckets: the finest step (at least the one counted in) that spans the data
/// in at most [`MAX_BARS`] bars, gaps filled so that the axis is time.
fn chart_buckets(times: &HashMap<i64, Bucket>, counted: i64) -> (&'static str, Vec<(i64, Bucket)>) {
    let (Some(&first), Some(&last)) = (times.keys().min(), times.keys().max()) else {
        return ("hour", Vec::new());
    };
    let step = STEPS
        .iter()
        .copied()
        .filter(|&s| s >= counted)
        .find(|&s| (last - first) / s < MAX_BARS)
        .unwrap_or(STEPS[STEPS.len() - 1]);
    let unit = match step {
        1 => "second",
        60 => "minute",
        3600 => "hour",
        _ => "day",
    };
    let counts = rebucket(times, step);
    let start = first - first.rem_euclid(step);
    let mut buckets = Vec::new();
    let mut at = start;
    while at <= last {
        buckets.push((at, counts.get(&at).copied().unwrap_or_default()));
        at += step;
    }
    (unit, buckets)
}

fn time_label(seconds: i64, unit: &str) -> String {
    let Some(time) = arrow::temporal_conversions::timestamp_s_to_datetime(seconds) else {
        return seconds.to_string();
    };
    let format = match unit {
        "day" => "%Y-%m-%d",
        "hour" => "%Y-%m-%d %H:00",
        "minute" => "%Y-%m-%d %H:%M",
        _ => "%Y-%m-%d %H:%M:%S",
    };
    time.format(format).to_string()
}

/// The duplicate rate per bucket as an SVG bar chart.
fn chart(unit: &str, buckets: &[(i64, Bucket)]) -> String {
    const WIDTH: f64 = 960.0;
    const HEIGHT: f64 = 300.0;
    const LEFT: f64 = 64.0;
    const BOTTOM: f64 = 48.0;
    const TOP: f64 = 16.0;
    let plot_width = WIDTH - LEFT - 16.0;
    let plot_height = HEIGHT - BOTTOM - TOP;
    let rate = |b: &Bucket| {
        if b.rows == 0 {
            0.0
        } else {
            b.copies as f64 / b.rows as f64
        }
    };
    let highest = buckets.iter().map(|(_, b)| rate(b)).fold(0.0, f64::max);
    // Four gridlines at a round step (in percent), the top one at or above every bar.
    let tick = [0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 20.0, 25.0]
        .into_iter()
        .find(|&t| 4.0 * t >= highest * 100.0)
        .unwrap_or(25.0);
    let top = 4.0 * tick / 100.0;
    let slot = plot_width / buckets.len().max(1) as f64;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg id="duplicate-rate-chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" aria-label="Duplicate rate per {unit}">"#
    );
    for step in 0..=4 {
        // Multiples of the round step print exactly (no 10.000000000000002%).
        let percent = tick * f64::from(step);
        let y = TOP + plot_height * (1.0 - f64::from(step) / 4.0);
        let _ = write!(
            svg,
            r##"<line class="grid" x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}"/><text class="axis" x="{}" y="{:.1}" text-anchor="end">{}%</text>"##,
            WIDTH - 16.0,
            LEFT - 6.0,
            y + 4.0,
            percent
        );
    }
    for (index, (start, bucket)) in buckets.iter().enumerate() {
        let height = plot_height * rate(bucket) / top;
        let x = LEFT + slot * index as f64;
        let _ = write!(
            svg,
            r#"<rect class="bar" x="{:.2}" y="{:.2}" width="{:.2}" height="{height:.2}"><title>{}: {} of {} rows are copies ({})</title></rect>"#,
            x + slot * 0.1,
            TOP + plot_height - height,
            (slot * 0.8).max(0.5),
            escape(&time_label(*start, unit)),
            bucket.copies,
            bucket.rows,
            percent(bucket.copies, bucket.rows)
        );
    }
    let ticks = [0, buckets.len() / 2, buckets.len().saturating_sub(1)];
    let mut last_tick = None;
    for index in ticks {
        if last_tick == Some(index) || index >= buckets.len() {
            continue;
        }
        last_tick = Some(index);
        // The first label starts at its bar, the last ends at its bar: both stay inside.
        let (x, anchor) = if index == 0 {
            (LEFT + slot * index as f64, "start")
        } else if index + 1 == buckets.len() {
            (LEFT + slot * (index as f64 + 1.0), "end")
        } else {
            (LEFT + slot * (index as f64 + 0.5), "middle")
        };
        let _ = write!(
            svg,
            r#"<text class="axis" x="{x:.1}" y="{:.1}" text-anchor="{anchor}">{}</text>"#,
            HEIGHT - BOTTOM + 18.0,
            escape(&time_label(buckets[index].0, unit))
        );
    }
    svg.push_str("</svg>");
    svg
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:1000px;\
color:#222}h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em}table{border-collapse:collapse}\
td,th{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:left}td.n{text-align:right;\
font-variant-numeric:tabular-nums}.bar{fill:#c0392b}.grid{stroke:#e5e5e5}.axis{font-size:11px;\
fill:#555}.note{color:#666}code{font-size:.95em}";

fn render(
    report: &DedupReport,
    options: &ReportOptions,
    observed: &Observed,
    shown: &HashMap<u64, String>,
) -> String {
    let stats = &report.stats;
    let mut page = String::new();
    let _ = write!(
        page,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>idem dedup report</title><style>{STYLE}</style></head><body>\
         <h1>idem dedup report</h1><p class=\"note\">Key <code>{}</code>, version <code>{}</code>; \
         {} input files → <code>{}</code>.</p>",
        escape(&report.key.join(", ")),
        escape(&report.version.join(", ")),
        report.input_files,
        escape(&report.output)
    );
    let rows = [
        ("Rows in", stats.rows_in.to_string()),
        ("Rows out", stats.rows_out.to_string()),
        (
            "Duplicates (same key and version)",
            stats.duplicates.to_string(),
        ),
        (
            "Superseded (older version of a key)",
            stats.superseded.to_string(),
        ),
        ("Duplicate rate", format!("{:.4}", report.duplicate_rate)),
        ("Distinct keys", stats.distinct_keys.to_string()),
        ("Conflicting ties", stats.conflicts.to_string()),
        ("Rows with a null key", stats.null_keys.to_string()),
        ("Wall time", format!("{:.2} s", report.elapsed_seconds)),
    ];
    page.push_str("<h2>Run</h2><table id=\"summary\">");
    for (name, value) in rows {
        let _ = write!(page, "<tr><th>{name}</th><td class=\"n\">{value}</td></tr>");
    }
    page.push_str("</table>");

    match &options.time_column {
        Some(column) => {
            let (unit, buckets) = chart_buckets(&observed.times, observed.step);
            let _ = write!(
                page,
                "<h2>Duplicate rate per {unit} of <code>{}</code></h2>\
                 <p class=\"note\">Share of each {unit}'s rows whose key arrived earlier in \
                 the input (a copy is charted at its own event time).</p>{}",
                escape(column),
                chart(unit, &buckets)
            );
            if observed.untimed.rows > 0 {
                let _ = write!(
                    page,
                    "<p class=\"note\">{} rows have no {}: {} of them are copies.</p>",
                    observed.untimed.rows,
                    escape(column),
                    observed.untimed.copies
                );
            }
        }
        None => page.push_str(
            "<p class=\"note\">Give <code>--time-column</code> to chart the duplicate rate \
             over event time.</p>",
        ),
    }

    page.push_str(
        "<h2>Input files</h2><table id=\"inputs\"><tr><th>File</th><th>Rows</th>\
         <th>Kept</th><th>Dropped</th><th>Dropped share</th></tr>",
    );
    for input in &report.inputs {
        let kept = input.kept.unwrap_or(0);
        let dropped = input.dropped.unwrap_or(0);
        let _ = write!(
            page,
            "<tr><td><code>{}</code></td><td class=\"n\">{}</td><td class=\"n\">{kept}</td>\
             <td class=\"n\">{dropped}</td><td class=\"n\">{}</td></tr>",
            escape(&input.path),
            input.rows,
            percent(dropped, input.rows)
        );
    }
    page.push_str("</table>");

    page.push_str("<h2>Keys delivered most often</h2>");
    if observed.top.is_empty() {
        page.push_str("<p class=\"note\">No key arrived more than once.</p>");
    } else {
        page.push_str("<table id=\"top-keys\"><tr><th>Key</th><th>Copies received</th></tr>");
        for (count, hash) in &observed.top {
            let key = shown.get(hash).map_or("?", String::as_str);
            let _ = write!(
                page,
                "<tr><td><code>{}</code></td><td class=\"n\">{count}</td></tr>",
                escape(key)
            );
        }
        page.push_str("</table>");
    }
    page.push_str("</body></html>\n");
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_is_escaped() {
        assert_eq!(
            escape(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn the_finest_readable_step_is_charted_with_gaps_filled() {
        let bucket = Bucket {
            rows: 10,
            copies: 1,
        };
        let seconds: HashMap<i64, Bucket> = [(0, bucket), (3, bucket)].into();
        let (unit, buckets) = chart_buckets(&seconds, 1);
        assert_eq!((unit, buckets.len()), ("second", 4));
        assert_eq!(buckets[1].1.rows, 0);
        let hours: HashMap<i64, Bucket> = [(0, bucket), (3 * 3600, bucket)].into();
        assert_eq!(chart_buckets(&hours, 1).0, "minute");
        let days: HashMap<i64, Bucket> = [(0, bucket), (60, bucket), (9 * 86_400, bucket)].into();
        let (unit, buckets) = chart_buckets(&days, 60);
        assert_eq!((unit, buckets.len()), ("hour", 217));
        assert_eq!((buckets[0].1.rows, buckets[0].1.copies), (20, 2));
        let months: HashMap<i64, Bucket> = [(0, bucket), (90 * 86_400, bucket)].into();
        assert_eq!(chart_buckets(&months, 3600).1.len(), 91);
    }
}
