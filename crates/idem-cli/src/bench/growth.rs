//! `idem bench --growth N`: bytes per stored record, and a purge of N expired records
//! measured against the new requests it slows down, in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::engines::{FILL_CHUNK, TYPICAL_REQUEST, TYPICAL_RESPONSE};
use super::{BenchEngine, Ctx, Options, Path, Report, Sample, progress, run_cell};
use crate::fail::Fail;

/// Rows per purge statement (the `idem purge` default).
const PURGE_BATCH: u32 = 1000;
/// Records older than this are purged; the filled ones are two days old.
const PURGE_OLDER_THAN: Duration = Duration::from_secs(3600);
/// New requests are measured in slices this long while the purge runs.
const SLICE: Duration = Duration::from_secs(1);
/// At most this many slices (a hang guard: about an hour).
const MAX_SLICES: u32 = 3600;

/// What the growth mode measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Growth {
    pub(crate) records: u64,
    pub(crate) typical_request: String,
    pub(crate) typical_response: String,
    pub(crate) size_method: String,
    pub(crate) bytes_before: u64,
    pub(crate) bytes_after: u64,
    pub(crate) bytes_per_record: f64,
    pub(crate) fill_seconds: f64,
    pub(crate) purged: u64,
    pub(crate) purge_batch: u32,
    pub(crate) purge_seconds: f64,
    pub(crate) purged_per_s: f64,
    pub(crate) clients: usize,
    pub(crate) new_ops_per_s_alone: f64,
    pub(crate) new_p99_us_alone: f64,
    pub(crate) new_ops_per_s_during_purge: f64,
    pub(crate) new_p99_us_during_purge: f64,
    /// New requests during the purge ÷ new requests alone, same table, same run.
    pub(crate) during_over_alone: f64,
}

pub(super) async fn run<K: BenchEngine>(
    ctx: &Arc<Ctx<K>>,
    records: u64,
    opts: &Options,
) -> Result<Growth, Fail> {
    let chunks = records.div_ceil(FILL_CHUNK).max(1);
    let records = chunks * FILL_CHUNK;
    let bar = progress(chunks + 2);
    bar.set_message(format!("filling {records} expired records"));
    let bytes_before = K::stored_bytes(&ctx.backend).await?;
    let fill = Instant::now();
    for i in 0..chunks {
        K::fill_expired(&ctx.backend, i * FILL_CHUNK).await?;
        bar.inc(1);
    }
    let fill_seconds = fill.elapsed().as_secs_f64();
    let bytes_after = K::stored_bytes(&ctx.backend).await?;
    let clients = opts.clients.iter().copied().max().unwrap_or(1);

    bar.set_message(format!("new requests alone, {clients} clients"));
    let mut alone = run_cell(ctx, Path::New, clients, opts.duration).await;
    bar.inc(1);

    bar.set_message("purge with new requests running");
    let idem = ctx.idem.clone();
    let started = Instant::now();
    let purge = tokio::spawn(async move {
        let report = idem.purge(PURGE_OLDER_THAN, PURGE_BATCH).await;
        (report, started.elapsed())
    });
    let mut during = Sample::default();
    let mut slices = 0;
    while !purge.is_finished() && slices < MAX_SLICES {
        during.absorb(run_cell(ctx, Path::New, clients, SLICE).await);
        slices += 1;
    }
    let (purged, took) = match purge.await {
        Ok((Ok(report), took)) => (report.requests, took),
        Ok((Err(e), _)) => return Err(e.into()),
        Err(e) => return Err(Fail::new(1, format!("the purge task failed: {e}"))),
    };
    bar.finish_and_clear();
    if purged != records {
        return Err(Fail::new(
            1,
            format!(
                "the purge removed {purged} of the {records} expired records the bench filled \
                 (the fill and the purge disagree on what has expired)"
            ),
        ));
    }
    for s in [&alone, &during] {
        if let Some(e) = &s.first_error {
            return Err(Fail::new(1, format!("a new request failed: {e}")));
        }
    }
    let purge_seconds = took.as_secs_f64();
    let (a, d) = (alone.ops_per_s(), during.ops_per_s());
    Ok(Growth {
        records,
        typical_request: TYPICAL_REQUEST.into(),
        typical_response: TYPICAL_RESPONSE.into(),
        size_method: K::SIZE_METHOD.into(),
        bytes_before,
        bytes_after,
        bytes_per_record: bytes_after.saturating_sub(bytes_before) as f64 / records as f64,
        fill_seconds,
        purged,
        purge_batch: PURGE_BATCH,
        purge_seconds,
        purged_per_s: purged as f64 / purge_seconds.max(f64::EPSILON),
        clients,
        new_ops_per_s_alone: a,
        new_p99_us_alone: alone.percentile(0.99),
        new_ops_per_s_during_purge: d,
        new_p99_us_during_purge: during.percentile(0.99),
        during_over_alone: if a > 0.0 { d / a } else { 0.0 },
    })
}

pub(super) fn print(report: &Report) {
    let Some(g) = &report.growth else { return };
    say!(
        "idem bench --growth on {} ({}), {} build; load average before {}, after {}",
        report.engine,
        report.server,
        report.build,
        report.load_before,
        report.load_after
    );
    say!(
        "stored record (UUID key, request {}, response {}): {:.0} bytes per record, table plus indexes \
         ({} → {} bytes over {} records; {})",
        g.typical_request,
        g.typical_response,
        g.bytes_per_record,
        g.bytes_before,
        g.bytes_after,
        g.records,
        g.size_method
    );
    say!(
        "purge of {} expired records in batches of {}: {:.1} s, {:.0} records/s",
        g.purged,
        g.purge_batch,
        g.purge_seconds,
        g.purged_per_s
    );
    say!(
        "new requests at {} clients: {:.1} ops/s alone (p99 {:.0} µs), {:.1} ops/s during the purge (p99 {:.0} µs): ratio {:.2}",
        g.clients,
        g.new_ops_per_s_alone,
        g.new_p99_us_alone,
        g.new_ops_per_s_during_purge,
        g.new_p99_us_during_purge,
        g.during_over_alone
    );
}
