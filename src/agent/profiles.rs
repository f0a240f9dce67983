//! The agent's pprof pull endpoints, `GET /debug/pprof/profile?seconds=N`: the convention of
//! Go's `net/http/pprof`, which Grafana Alloy's `pyroscope.scrape`, Parca's `scrape_configs`
//! and `go tool pprof http://HOST/debug/pprof/profile` read. The request waits `N` seconds
//! (default 30, at most [`Profiles::max_seconds`]) and answers a gzipped pprof profile of the
//! CPU samples every target thread took in exactly those seconds, read back from the agent's
//! own segments: the same samples, stacks and names that `report` and `flame` read from them,
//! with `pid`, `tid` and `thread_name` labels on each sample. `/debug/pprof/offcpu` and
//! `/debug/pprof/gil` answer the same way with the time threads spent off CPU (by the stack
//! where they blocked, label `state`) and waiting for the GIL (by the waiter's stack, labels
//! `gil_holder_tid` and `gil_holder`), each interval counted for its part inside the window.
//!
//! The agent stores samples added up per `--profile-seconds` interval (10 s), their times
//! spread evenly over it, written when it ends. So a request ends the interval being added up
//! when its window begins and again when it ends (the recorder does it at its next 200 ms
//! check, `RotationPolicy::cut_interval`): the window is then whole intervals but for up to
//! 0.2 s at either end, which count pro rata (the profile's comment says so). The answer comes
//! 0.6 s after the window, once the recorder has written it (Go's `go tool pprof` gives up after
//! 1.5 times the seconds asked for). With `--raw-events` every sample keeps its own time.
//!
//! Bounds: at most [`MAX_AT_ONCE`] profiles are built at once (more are answered `429` at
//! once); only the segments written to since the request began are read (each at most the
//! rotation policy's segment size), one at a time, and dropped once their samples are added.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;

use crate::record::rotate::list_segments;
use crate::views::pprof;
use crate::views::Selection;

/// Profiles built at once.
pub(crate) const MAX_AT_ONCE: usize = 2;
/// The seconds a request without `seconds=` waits (Go's default).
pub(crate) const DEFAULT_SECONDS: u64 = 30;
/// How long after an event the recorder has surely written it: it flushes every 200 ms
/// (`sampler::recorder::FLUSH_EVERY`), and a drain may hold a batch as long.
const FLUSHED_WITHIN: Duration = Duration::from_millis(600);

/// The longest window served: five minutes, and less than the segments kept by age (a window
/// whose first segment is pruned while it is built would read short).
fn max_seconds(pol: &crate::record::rotate::RotationPolicy) -> u64 {
    let kept = pol
        .max_segment_age
        .as_secs()
        .saturating_mul(pol.max_segments.saturating_sub(1) as u64);
    kept.clamp(1, 300)
}

/// What the endpoint reads: the agent's segment directory.
pub struct Profiles {
    pub dir: PathBuf,
    /// The longest window a request may ask for (the rotation policy's retention bounds what
    /// is kept anyway).
    pub max_seconds: u64,
    /// The aggregation interval (`None`: raw events).
    aggregate: Option<Duration>,
    /// Ends the recorder's aggregation interval at its next check.
    cut: Arc<AtomicBool>,
    building: AtomicUsize,
}

/// Why a request was not answered with a profile: (status line, message).
pub(crate) type Refusal = (&'static str, String);

impl Profiles {
    /// The agent's: its segments, their retention, its aggregation interval and its
    /// recorder's interval cut.
    pub(crate) fn of_agent(opts: &super::AgentOptions) -> Self {
        let pol = &opts.rotation;
        Profiles::new(
            &pol.dir,
            max_seconds(pol),
            opts.record.aggregate,
            pol.cut_interval.clone(),
        )
    }

    pub fn new(
        dir: &Path,
        max_seconds: u64,
        aggregate: Option<Duration>,
        cut: Arc<AtomicBool>,
    ) -> Self {
        Profiles {
            dir: dir.to_path_buf(),
            max_seconds,
            aggregate,
            cut,
            building: AtomicUsize::new(0),
        }
    }

    /// The seconds asked for by `query` (the part of the path after `?`).
    pub fn seconds(&self, query: &str) -> Result<u64, Refusal> {
        let Some(v) = query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "seconds")
            .map(|(_, v)| v)
        else {
            return Ok(DEFAULT_SECONDS.min(self.max_seconds));
        };
        match v.parse::<u64>() {
            Ok(s) if (1..=self.max_seconds).contains(&s) => Ok(s),
            _ => Err((
                "400 Bad Request",
                format!(
                    "seconds={v}: ask for a whole number of seconds from 1 to {}\n",
                    self.max_seconds
                ),
            )),
        }
    }

    /// Wait `seconds`, then the profile of exactly those seconds, gzipped.
    pub fn profile(&self, kind: pprof::Kind, seconds: u64) -> Result<Vec<u8>, Refusal> {
        if self.building.fetch_add(1, Ordering::SeqCst) >= MAX_AT_ONCE {
            self.building.fetch_sub(1, Ordering::SeqCst);
            return Err((
                "429 Too Many Requests",
                format!("{MAX_AT_ONCE} profiles are being built already; ask again later\n"),
            ));
        }
        let r = self.wait_and_build(kind, seconds);
        self.building.fetch_sub(1, Ordering::SeqCst);
        r.map_err(|e| ("500 Internal Server Error", format!("{e:#}\n")))
    }

    fn wait_and_build(&self, kind: pprof::Kind, seconds: u64) -> anyhow::Result<Vec<u8>> {
        let since = SystemTime::now();
        let t0 = crate::sys::monotonic_ns();
        self.edge();
        let span = Duration::from_secs(seconds);
        std::thread::sleep(span);
        self.edge();
        let p = self.build(kind, since, t0, t0 + span.as_nanos() as u64)?;
        pprof::encode(&p)
    }

    /// A window's edge: the recorder ends its aggregation interval at its next check.
    pub fn edge(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    /// The profile of `[t0, t1)` (CLOCK_MONOTONIC ns), begun at `since` on the wall clock,
    /// once the recorder has written it ([`FLUSHED_WITHIN`] after its end edge: this waits).
    pub fn build(
        &self,
        kind: pprof::Kind,
        since: SystemTime,
        t0: u64,
        t1: u64,
    ) -> anyhow::Result<pprof::proto::Profile> {
        std::thread::sleep(FLUSHED_WITHIN);
        let how = how(self.aggregate);
        between(kind, &self.dir, since, t0, t1, unix_ns(since), &how)
    }
}

/// `t` in ns since the epoch (0 before it).
pub(crate) fn unix_ns(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// What the profile's comment says of its window's ends.
fn how(aggregate: Option<Duration>) -> String {
    match aggregate {
        Some(a) => format!(
            "samples added up per interval (at most {:.0} s, cut at the window's ends within 0.2 s): a part of one straddling an end counts pro rata",
            a.as_secs_f64()
        ),
        None => "every sample at its own time".to_string(),
    }
}

/// The profile of `[t0, t1)` (CLOCK_MONOTONIC ns) from the segments in `dir` written to at or
/// after `since`; `unix0` is `t0` on the wall clock (the profile's `time_nanos`).
pub fn between(
    kind: pprof::Kind,
    dir: &Path,
    since: SystemTime,
    t0: u64,
    t1: u64,
    unix0: i64,
    how: &str,
) -> anyhow::Result<pprof::proto::Profile> {
    let mut b = pprof::Builder::of(kind);
    let mut period = 0;
    let segs = list_segments(dir).with_context(|| format!("listing {}", dir.display()))?;
    for s in segs {
        // A segment last written before the window began holds nothing in it.
        let written = std::fs::metadata(&s.path).and_then(|m| m.modified());
        if written.is_ok_and(|w| w + Duration::from_secs(1) < since) {
            continue;
        }
        // A segment removed by rotation meanwhile, or cut short, reads as what is there.
        let Ok(rec) = crate::record::read_recording(&s.path) else {
            continue;
        };
        let start = rec.meta.start_mono_ns;
        if t1 <= start {
            continue;
        }
        if period == 0 {
            period = rec
                .meta
                .period()
                .map_or(0, |p| i64::try_from(p.ns()).unwrap_or(0));
        }
        let sel = Selection::all(&rec).during(t0.saturating_sub(start), t1 - start);
        b.add(&rec, &sel);
    }
    Ok(b.finish(
        unix0,
        i64::try_from(t1 - t0).unwrap_or(i64::MAX),
        period,
        &["recorded by enginescope agent".to_string(), how.to_string()],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_default_range_and_refusals() {
        let p = Profiles::new(Path::new("/nonexistent"), 60, None, Default::default());
        assert_eq!(p.seconds(""), Ok(30));
        assert_eq!(p.seconds("seconds=5"), Ok(5));
        assert_eq!(p.seconds("debug=0&seconds=60"), Ok(60));
        for bad in [
            "seconds=0",
            "seconds=61",
            "seconds=-1",
            "seconds=1.5",
            "seconds=",
        ] {
            let e = p.seconds(bad).unwrap_err();
            assert!(e.0.starts_with("400"), "{bad}: {e:?}");
        }
        assert_eq!(
            Profiles::new(Path::new("/x"), 10, None, Default::default()).seconds(""),
            Ok(10)
        );
    }

    #[test]
    fn a_missing_directory_is_an_error_that_says_which() {
        let (dir, now) = (Path::new("/nonexistent/es"), SystemTime::now());
        let e = between(pprof::Kind::Cpu, dir, now, 0, 1, 0, "").unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/es"), "{e:#}");
    }
}
