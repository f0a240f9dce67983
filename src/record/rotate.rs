//! Rotating recordings: a directory of segments, each a complete `.esrec` that `report`,
//! `flame`, `export` and `diff` read on its own (the recorder starts every segment with the
//! processes, threads, engines, metric series and probes it refers to). A segment ends when it
//! reaches a size or an age; the oldest segments are removed to keep the directory under a
//! total size and count. The always-on agent (`enginescope agent`) records this way.
//!
//! Segment names sort in time order: `seg-YYYYMMDDTHHMMSSZ-NNNNNN.esrec` (UTC start, then a
//! sequence number that makes names unique within a second and across agent restarts).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// When to start a new segment and how many to keep.
#[derive(Debug, Clone)]
pub struct RotationPolicy {
    pub dir: PathBuf,
    /// A segment ends once it holds this many bytes (checked every 200 ms).
    pub max_segment_bytes: u64,
    /// … or once it is this old.
    pub max_segment_age: Duration,
    /// Oldest segments are removed while all of them together exceed this (the segment being
    /// written is never removed).
    pub max_total_bytes: u64,
    /// … or while there are more than this many.
    pub max_segments: usize,
    /// Set to end the current segment at the next check (then cleared): the agent does this
    /// when its memory passes its cap, since a new segment starts with empty frame and stack
    /// tables.
    pub rotate_now: Arc<AtomicBool>,
    /// Set to end the current aggregation interval at the next check (then cleared): the
    /// agent's profile endpoint does this at both ends of the window it serves, so that the
    /// window is whole intervals instead of parts of 10 s ones.
    pub cut_interval: Arc<AtomicBool>,
}

impl RotationPolicy {
    pub fn new(dir: PathBuf) -> Self {
        RotationPolicy {
            dir,
            max_segment_bytes: 64 << 20,
            max_segment_age: Duration::from_secs(600),
            max_total_bytes: 1 << 30,
            max_segments: 1000,
            rotate_now: Arc::new(AtomicBool::new(false)),
            cut_interval: Arc::new(AtomicBool::new(false)),
        }
    }
}

const PREFIX: &str = "seg-";
const SUFFIX: &str = ".esrec";

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// `YYYYMMDDTHHMMSSZ` for seconds since the Unix epoch.
pub(crate) fn utc_stamp(unix_s: f64) -> String {
    let s = if unix_s.is_finite() && unix_s > 0.0 {
        unix_s as i64
    } else {
        0
    };
    let (y, mo, d) = civil_from_days(s.div_euclid(86_400));
    let t = s.rem_euclid(86_400);
    format!(
        "{y:04}{mo:02}{d:02}T{:02}{:02}{:02}Z",
        t / 3600,
        (t / 60) % 60,
        t % 60
    )
}

/// The file name of a segment started at `unix_s` with sequence number `seq`.
pub(crate) fn segment_name(unix_s: f64, seq: u64) -> String {
    format!(
        "{PREFIX}{}-{:06}{SUFFIX}",
        utc_stamp(unix_s),
        seq % 1_000_000
    )
}

/// Whether `name` is a segment's file name.
pub(crate) fn is_segment_name(name: &str) -> bool {
    name.strip_prefix(PREFIX)
        .and_then(|r| r.strip_suffix(SUFFIX))
        .is_some_and(|mid| {
            mid.len() == 23
                && mid
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b == b'T' || b == b'Z' || b == b'-')
        })
}

/// A segment on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub path: PathBuf,
    pub bytes: u64,
}

/// Segments in `dir`, oldest first (by name). At most `limit` are listed (the oldest ones;
/// the directory is kept far below that by pruning).
pub fn list_segments(dir: &Path) -> std::io::Result<Vec<Segment>> {
    const LIMIT: usize = 100_000;
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)?.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !is_segment_name(name) {
            continue;
        }
        let Ok(md) = e.metadata() else { continue };
        if !md.is_file() {
            continue;
        }
        out.push(Segment {
            path: e.path(),
            bytes: md.len(),
        });
        if out.len() >= LIMIT {
            break;
        }
    }
    out.sort_by(|a, b| a.path.file_name().cmp(&b.path.file_name()));
    Ok(out)
}

/// A path for a new segment in `dir`, after every segment already there: the sequence number
/// goes on from the newest one's (so a restarted agent's segments sort after its earlier
/// ones even within the same second).
pub(crate) fn next_segment_path(
    dir: &Path,
    unix_s: f64,
    seq: &mut u64,
) -> std::io::Result<PathBuf> {
    let existing = list_segments(dir)?;
    if let Some(last) = existing.last() {
        let last_seq = last
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(SUFFIX))
            .and_then(|n| n.rsplit('-').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        *seq = (*seq).max(last_seq + 1);
    }
    let newest = existing
        .last()
        .and_then(|l| l.path.file_name())
        .and_then(|n| n.to_str())
        .map(String::from);
    for _ in 0..1000 {
        let mut name = segment_name(unix_s, *seq);
        if let Some(l) = &newest {
            if name.as_str() <= l.as_str() {
                // The clock stepped back: keep the newest's time stamp, so that the name
                // (with a larger sequence number) still sorts after it.
                let stamp = &l[PREFIX.len()..PREFIX.len() + 16];
                name = format!("{PREFIX}{stamp}-{:06}{SUFFIX}", *seq % 1_000_000);
            }
        }
        *seq += 1;
        let p = dir.join(&name);
        if !p.exists() {
            return Ok(p);
        }
    }
    Err(std::io::Error::other(
        "no free segment name (more than a million segments?)",
    ))
}

/// Remove the oldest segments of `dir` (never `current`) while their total size is over
/// `max_total_bytes` or their number over `max_segments`. Returns the removed paths.
pub(crate) fn prune(
    dir: &Path,
    current: &Path,
    max_total_bytes: u64,
    max_segments: usize,
) -> std::io::Result<Vec<PathBuf>> {
    let segs = list_segments(dir)?;
    let mut total: u64 = segs.iter().map(|s| s.bytes).sum();
    let mut count = segs.len();
    let mut removed = Vec::new();
    for s in &segs {
        if total <= max_total_bytes && count <= max_segments {
            break;
        }
        if s.path == current {
            continue;
        }
        match std::fs::remove_file(&s.path) {
            Ok(()) => removed.push(s.path.clone()),
            // Removed by someone else meanwhile: it no longer counts either way.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        total -= s.bytes;
        count -= 1;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_and_names() {
        assert_eq!(utc_stamp(0.0), "19700101T000000Z");
        // 2024-02-29 23:59:59 UTC (leap day)
        assert_eq!(utc_stamp(1_709_251_199.9), "20240229T235959Z");
        // 2000-03-01 00:00:00 UTC
        assert_eq!(utc_stamp(951_868_800.0), "20000301T000000Z");
        let n = segment_name(1_709_251_199.0, 42);
        assert_eq!(n, "seg-20240229T235959Z-000042.esrec");
        assert!(is_segment_name(&n));
        assert!(!is_segment_name("seg-x.esrec"));
        assert!(!is_segment_name("run.esrec"));
        assert!(!is_segment_name("seg-20240229T235959Z-000042.esrec.tmp"));
    }

    #[test]
    fn next_path_sorts_after_existing_and_prune_keeps_caps() {
        let d = tempfile::tempdir().unwrap();
        let mut seq = 0;
        let mut paths = Vec::new();
        for i in 0..5 {
            // The clock stepping back must not make a name sort before existing ones.
            let t = if i == 3 { 1_000.0 } else { 2_000.0 + i as f64 };
            let p = next_segment_path(d.path(), t, &mut seq).unwrap();
            std::fs::write(&p, vec![0u8; 100]).unwrap();
            paths.push(p);
        }
        std::fs::write(d.path().join("other.esrec"), b"x").unwrap();
        let listed: Vec<PathBuf> = list_segments(d.path())
            .unwrap()
            .into_iter()
            .map(|s| s.path)
            .collect();
        assert_eq!(listed, paths, "names sort in creation order");
        // A restarted agent (sequence from 0) still names after the newest.
        let mut seq2 = 0;
        let p = next_segment_path(d.path(), 2_010.0, &mut seq2).unwrap();
        assert!(p.file_name() > paths[4].file_name());

        // 5 × 100 bytes, cap 250: the 3 oldest go, the newest 2 stay.
        let removed = prune(d.path(), &paths[4], 250, 100).unwrap();
        assert_eq!(removed, paths[..3].to_vec());
        assert!(d.path().join("other.esrec").exists());
        // The current segment is never removed, even alone over the cap.
        let removed = prune(d.path(), &paths[4], 0, 100).unwrap();
        assert_eq!(removed, vec![paths[3].clone()]);
        assert!(paths[4].exists());
        // By count.
        for _ in 0..3 {
            let p = next_segment_path(d.path(), 3_000.0, &mut seq).unwrap();
            std::fs::write(&p, b"").unwrap();
        }
        let cur = list_segments(d.path())
            .unwrap()
            .last()
            .unwrap()
            .path
            .clone();
        prune(d.path(), &cur, u64::MAX, 2).unwrap();
        assert_eq!(list_segments(d.path()).unwrap().len(), 2);
    }
}
