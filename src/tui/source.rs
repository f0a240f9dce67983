//! Where the dashboard's recording comes from: a file the recorder is appending to
//! ([`Follow`]), or a finished one replayed by event time ([`Replay`]). Both hand the window a
//! [`Recording`] that only grows (until a replay jumps back), so everything downstream is one
//! code path.

use std::io::Read;
use std::path::Path;

use anyhow::Context;

use crate::record::format::RecordingReader;
use crate::record::Recording;

/// Most bytes taken in per poll: a bound on one update's work when the dashboard starts on a
/// large file or falls behind (the rest comes at the next poll).
pub(crate) const MAX_READ_PER_POLL: usize = 8 << 20;

/// Follows a recording file while its writer appends to it.
pub struct Follow {
    file: std::fs::File,
    reader: RecordingReader,
    buf: Vec<u8>,
}

impl Follow {
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        Ok(Follow {
            file: std::fs::File::open(path)
                .with_context(|| format!("opening {}", path.display()))?,
            reader: RecordingReader::default(),
            buf: vec![0; 1 << 16],
        })
    }

    /// Apply what was appended since the last poll. Returns the bytes read.
    pub fn poll(&mut self) -> anyhow::Result<usize> {
        let mut total = 0;
        while total < MAX_READ_PER_POLL {
            let n = self
                .file
                .read(&mut self.buf)
                .context("reading the recording")?;
            if n == 0 {
                break;
            }
            self.reader.feed(&self.buf[..n])?;
            total += n;
        }
        Ok(total)
    }

    pub fn has_meta(&self) -> bool {
        self.reader.has_meta()
    }

    pub fn recording(&self) -> &Recording {
        &self.reader.recording
    }

    pub(crate) fn recording_mut(&mut self) -> &mut Recording {
        &mut self.reader.recording
    }
}

/// Time at which an event is known to a live follower: when the recorder writes it, i.e. a
/// sample at its time and an interval at its end.
fn end(start: u64, dur: u64) -> u64 {
    start.saturating_add(dur)
}

/// Indices of `v` sorted by `key` (stable).
fn order<T>(v: &[T], key: impl Fn(&T) -> u64) -> Vec<usize> {
    let mut o: Vec<usize> = (0..v.len()).collect();
    o.sort_by_key(|&i| key(&v[i]));
    o
}

/// Replays a finished recording: events enter a staged recording in the order a live follower
/// would have seen them, up to a clock that the caller moves.
pub struct Replay {
    full: Recording,
    /// What has "happened" up to the clock.
    pub staged: Recording,
    orders: Orders,
    /// How many of each `orders` list are staged or skipped.
    next: Counts,
    clock_ns: u64,
    pub len_ns: u64,
}

/// Per kind: indices of the full recording's events in the order they are staged.
struct Orders {
    samples: Vec<usize>,
    offcpu: Vec<usize>,
    gil_waits: Vec<usize>,
    wakes: Vec<usize>,
    gc_pauses: Vec<usize>,
    calls: Vec<usize>,
    metrics: Vec<usize>,
    threads: Vec<usize>,
    engines: Vec<usize>,
    probes: Vec<usize>,
    probe_watches: Vec<usize>,
    scrape_errors: Vec<usize>,
}

#[derive(Default)]
struct Counts {
    samples: usize,
    offcpu: usize,
    gil_waits: usize,
    wakes: usize,
    gc_pauses: usize,
    calls: usize,
    metrics: usize,
    threads: usize,
    engines: usize,
    probes: usize,
    probe_watches: usize,
    scrape_errors: usize,
}

impl Replay {
    pub fn new(full: Recording) -> Self {
        let len_ns = full.duration_ns();
        let orders = Orders {
            samples: order(&full.samples, |s| s.t_ns),
            offcpu: order(&full.offcpu, |o| end(o.start_ns, o.dur_ns)),
            gil_waits: order(&full.gil_waits, |g| end(g.start_ns, g.dur_ns)),
            wakes: order(&full.wakes, |w| w.t_ns),
            gc_pauses: order(&full.gc_pauses, |g| end(g.start_ns, g.dur_ns)),
            calls: order(&full.calls, |c| end(c.start_ns, c.dur_ns)),
            metrics: order(&full.metrics, |m| m.t_ns),
            threads: order(&full.threads, |t| t.t_ns),
            engines: order(&full.engines, |e| e.t_ns),
            probes: order(&full.probes, |p| p.t_ns),
            probe_watches: order(&full.probe_watches, |w| w.t_ns),
            scrape_errors: order(&full.scrape_errors, |e| e.t_ns),
        };
        let mut r = Replay {
            staged: Recording::default(),
            orders,
            next: Counts::default(),
            clock_ns: 0,
            len_ns,
            full,
        };
        r.restage(0);
        r
    }

    pub(crate) fn clock_ns(&self) -> u64 {
        self.clock_ns
    }

    pub(crate) fn at_end(&self) -> bool {
        self.clock_ns >= self.len_ns
    }

    /// Staged recording with the tables and no events; events from `from_ns` on come next.
    fn restage(&mut self, from_ns: u64) {
        let f = &self.full;
        self.staged = Recording {
            meta: f.meta.clone(),
            processes: f.processes.clone(),
            frames: f.frames.clone(),
            stacks: f.stacks.clone(),
            series: f.series.clone(),
            truncated: f.truncated,
            ..Recording::default()
        };
        // Tables that carry a time are staged like events, from the start; events that ended
        // before `from_ns` cannot reach the window and are skipped.
        let o = &self.orders;
        let skip =
            |ord: &[usize], key: &dyn Fn(usize) -> u64| ord.partition_point(|&i| key(i) < from_ns);
        self.next = Counts {
            samples: skip(&o.samples, &|i| f.samples[i].t_ns),
            offcpu: skip(&o.offcpu, &|i| {
                end(f.offcpu[i].start_ns, f.offcpu[i].dur_ns)
            }),
            gil_waits: skip(&o.gil_waits, &|i| {
                end(f.gil_waits[i].start_ns, f.gil_waits[i].dur_ns)
            }),
            gc_pauses: skip(&o.gc_pauses, &|i| {
                end(f.gc_pauses[i].start_ns, f.gc_pauses[i].dur_ns)
            }),
            wakes: skip(&o.wakes, &|i| f.wakes[i].t_ns),
            calls: skip(&o.calls, &|i| end(f.calls[i].start_ns, f.calls[i].dur_ns)),
            metrics: skip(&o.metrics, &|i| f.metrics[i].t_ns),
            ..Counts::default()
        };
        self.clock_ns = from_ns;
    }

    /// Move the clock to `t_ns` (clamped to the recording's length) and stage every event
    /// known by then. Going back rebuilds the staged recording from `t_ns - keep_ns` and
    /// returns true: the window must start over.
    pub(crate) fn seek(&mut self, t_ns: u64, keep_ns: u64) -> bool {
        let t = t_ns.min(self.len_ns);
        let reset = t < self.clock_ns;
        if reset {
            self.restage(t.saturating_sub(keep_ns));
        }
        self.clock_ns = t;
        let f = &self.full;
        let s = &mut self.staged;
        let o = &self.orders;
        let n = &mut self.next;
        macro_rules! stage {
            ($field:ident, $key:expr) => {
                while let Some(&i) = o.$field.get(n.$field) {
                    let e = &f.$field[i];
                    if $key(e) > t {
                        break;
                    }
                    s.$field.push(e.clone());
                    n.$field += 1;
                }
            };
        }
        stage!(samples, |e: &crate::record::Sample| e.t_ns);
        stage!(offcpu, |e: &crate::record::OffCpu| end(
            e.start_ns, e.dur_ns
        ));
        stage!(gil_waits, |e: &crate::record::GilWait| end(
            e.start_ns, e.dur_ns
        ));
        stage!(wakes, |e: &crate::record::Wake| e.t_ns);
        stage!(gc_pauses, |e: &crate::record::GcPause| end(
            e.start_ns, e.dur_ns
        ));
        stage!(calls, |e: &crate::record::FunctionCall| end(
            e.start_ns, e.dur_ns
        ));
        stage!(metrics, |e: &crate::record::MetricPoint| e.t_ns);
        stage!(threads, |e: &crate::record::ThreadInfo| e.t_ns);
        stage!(engines, |e: &crate::record::EngineInfo| e.t_ns);
        stage!(probes, |e: &crate::record::ProbeInfo| e.t_ns);
        stage!(probe_watches, |e: &crate::record::ProbeWatch| e.t_ns);
        stage!(scrape_errors, |e: &crate::record::ScrapeError| e.t_ns);
        if t >= self.len_ns {
            s.end = f.end.clone();
            s.counters = f.counters.clone();
        }
        reset
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{OffCpu, Sample, ThreadInfo};

    fn rec() -> Recording {
        let mut r = Recording {
            stacks: vec![vec![]],
            ..Recording::default()
        };
        r.threads.push(ThreadInfo {
            pid: 1,
            tid: 2,
            name: "late".into(),
            t_ns: 5_000,
            python_name: None,
        });
        for t in [1_000u64, 3_000, 2_000, 9_000] {
            r.samples.push(Sample {
                t_ns: t,
                pid: 1,
                tid: 2,
                stack: 0,
                flags: 0,
                weight_ns: 10,
            });
        }
        // Written when it ends, at 8 µs.
        r.offcpu.push(OffCpu {
            pid: 1,
            tid: 2,
            start_ns: 500,
            dur_ns: 7_500,
            stack: 0,
            preempted: false,
            stolen: false,
        });
        r.end = Some(crate::record::EndInfo {
            duration_ns: 10_000,
            reason: "done".into(),
        });
        r
    }

    #[test]
    fn stages_events_when_a_live_follower_would_see_them() {
        let mut rp = Replay::new(rec());
        assert_eq!(rp.len_ns, 10_000);
        assert!(!rp.seek(2_500, 0));
        let ts: Vec<u64> = rp.staged.samples.iter().map(|s| s.t_ns).collect();
        assert_eq!(ts, [1_000, 2_000]);
        assert!(rp.staged.threads.is_empty() && rp.staged.offcpu.is_empty());
        rp.seek(8_000, 0);
        assert_eq!(rp.staged.samples.len(), 3);
        assert_eq!(rp.staged.threads.len(), 1);
        assert_eq!(rp.staged.offcpu.len(), 1);
        assert!(rp.staged.end.is_none());
        rp.seek(u64::MAX, 0);
        assert!(rp.at_end());
        assert_eq!(rp.staged.samples.len(), 4);
        assert_eq!(
            rp.staged.end.as_ref().map(|e| e.reason.as_str()),
            Some("done")
        );
        // Back to 3.5 µs keeping 1 µs: events that ended before 2.5 µs are skipped.
        assert!(rp.seek(3_500, 1_000));
        let ts: Vec<u64> = rp.staged.samples.iter().map(|s| s.t_ns).collect();
        assert_eq!(ts, [3_000]);
        assert!(rp.staged.end.is_none());
        assert_eq!(rp.clock_ns(), 3_500);
    }
}
