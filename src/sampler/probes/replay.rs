//! What a perfect watcher under the probe schedule would time of a known call timeline, with
//! no kernel (issue 35's "selection effect").
//!
//! The calls of each probed function on each thread, as in-process timers saw them on a real
//! engine, are replayed through [`Probes`]' own schedule (its rotation and `--probe-budget`'s
//! on- and off-phases, sized from the traps the watched calls take) on the fake watchpoints
//! ([`super::watch::fake`]). A call counts as timed when it lies wholly inside one watched
//! interval, as a real watch times it; the estimate scales the timed calls by the share of the
//! window that was watched, as `views::latency` does ([`crate::estimate`]). The difference between that estimate and
//! every call of the timeline is what the schedule's choice of stretches costs (the selection
//! effect); the difference between it and what a recording's probe timed in the same stretches
//! is the probe's own effect on the calls (`tests/common/probe_truth.rs` measures that one).
//!
//! Not modelled: what a watched call costs its thread (its traps lengthen it), the recording
//! loop running late (it runs the schedule every [`Replay::tick_ns`] exactly), and the watched
//! threads' context switches in the budget's sizing (no scheduler counters here: the traps
//! alone size it).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::watch::fake::{FakeWatch, FakeWatchpoints};
use super::{Active, ProbeSpec, Probes};
use crate::cpython::binary::InterpreterBinary;
use crate::cpython::memory::FakeMemory;
use crate::cpython::offsets::PY312;
use crate::cpython::version::PyVersion;
use crate::cpython::PythonProcess;
use crate::estimate::{uncertainty, Coverage, LatencyMs, Uncertainty};
use crate::sampler::sink::Event;
use crate::sampler::Pipeline;

/// One call of the timeline: probe index, thread, and its start and length (ns, any one clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    pub probe: usize,
    pub tid: i32,
    pub start_ns: u64,
    pub dur_ns: u64,
}

/// How the schedule is run.
#[derive(Debug, Clone)]
pub struct Replay {
    /// `--probe-budget` as a share (0: every call watched).
    pub budget: f64,
    /// What one trap costs the thread it interrupts, ns (sizes the budget's phases).
    pub trap_ns: u64,
    /// How often the recording loop runs the schedule, ns.
    pub tick_ns: u64,
    /// Seed of the on-phases' lengths.
    pub seed: u64,
    /// When watching begins (the recording's start, on the calls' clock).
    pub start_ns: u64,
    /// The window the figures cover, `[from_ns, to_ns)` on the calls' clock.
    pub from_ns: u64,
    pub to_ns: u64,
}

/// What the schedule let a perfect watcher time of one probe on one thread, in the window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Watched {
    pub probe: usize,
    pub tid: i32,
    /// Watched time inside the window, ns, and its intervals (clipped to the window; times
    /// on the timeline's clock, as `timed`).
    pub watched_ns: u64,
    pub intervals: Vec<(u64, u64)>,
    /// (start, length) of the calls that began in the window and lie wholly inside one
    /// watched interval.
    pub timed: Vec<(u64, u64)>,
    /// Calls of the timeline that began in the window.
    pub all: Vec<u64>,
    /// The share of the time each of the thread's probes was watched at the end (the
    /// budget's duty).
    pub phase: f64,
}

impl Watched {
    /// The calls in the window and their latency as `report` estimates them from the timed
    /// ones: each timed call weighted by the window over the time a call of its length could
    /// have been watched whole ([`crate::views::latency::Coverage::weight`]), the percentiles
    /// weighted likewise. None when nothing was timed.
    pub fn estimate(&self, window_ns: u64) -> Option<(f64, LatencyMs)> {
        let cov = Coverage {
            span_ns: window_ns,
            intervals: self.intervals.clone(),
        };
        let strata = cov.strata();
        let mut w: Vec<(u64, f64)> = self
            .timed
            .iter()
            .map(|&(s, d)| (d, strata.weight(s, d)))
            .collect();
        let calls = w.iter().map(|c| c.1).sum();
        Some((calls, LatencyMs::of_weighted(&mut w)?))
    }

    /// The 95% intervals `report` prints beside that estimate
    /// ([`crate::views::latency::uncertainty`]).
    pub fn intervals(&self, window_ns: u64) -> Option<Uncertainty> {
        let cov = Coverage {
            span_ns: window_ns,
            intervals: self.intervals.clone(),
        };
        let strata = cov.strata();
        let calls: Vec<(u64, u64, f64)> = self
            .timed
            .iter()
            .map(|&(s, d)| (s, d, strata.weight(s, d)))
            .collect();
        uncertainty(&calls, &cov)
    }
}

/// Thread ids no process can have (above the kernel's largest `pid_max`), so that the schedule
/// reads no real thread's scheduler counters.
const FAKE_TID: i32 = 9_000_000;

/// An interpreter with nothing in its memory: the schedule reads a reference count to seed a
/// watch and takes "unreadable" for an answer.
fn empty_process() -> PythonProcess {
    let binary = InterpreterBinary {
        path: "replay".into(),
        opened_from: "replay".into(),
        is_shared_lib: false,
        pie: false,
        stripped: true,
        build_id: None,
        bias: 0,
        runtime_addr: 0,
        runtime_found_by: "replay".into(),
        symbols: HashMap::new(),
        bss: None,
    };
    PythonProcess::from_parts(
        1,
        Box::new(FakeMemory::new()),
        binary,
        PyVersion::new(3, 12, 1),
        PY312,
    )
}

/// Replay `calls` (of `probes` exact probes) through the schedule; one row per probe and
/// thread that has calls, in (probe, tid) order.
pub fn replay(probes: usize, calls: &[Call], r: &Replay) -> Vec<Watched> {
    let proc = empty_process();
    let mut k = FakeWatchpoints::default();
    let specs = (0..probes)
        .filter_map(|i| ProbeSpec::parse(&format!("p{i}")).ok())
        .collect();
    let mut p: Probes<FakeWatch> = Probes::new(specs, 10_000_000, true);
    p.rng = r.seed | 1;
    p.set_budget(r.budget);
    p.trap_ns = r.trap_ns;
    p.budget_trap_ns = r.trap_ns;
    let addr = |i: usize| 0x1000 * (i as u64 + 1);
    for i in 0..probes {
        p.by_addr.insert((1, addr(i)), i);
        p.active.push(Active::exact(i, 1, format!("p{i}"), addr(i)));
    }
    // The schedule takes the later of its `now` and the monotonic clock: the timeline is moved
    // far ahead of it. Threads get ids no real thread has.
    let base = crate::sys::monotonic_ns().saturating_add(1_000_000 * 1_000_000_000);
    let at = |t: u64| t.saturating_sub(r.start_ns).saturating_add(base);
    let mut tids: BTreeMap<i32, i32> = BTreeMap::new();
    for c in calls {
        let n = tids.len() as i32;
        tids.entry(c.tid).or_insert(FAKE_TID + n);
    }
    // Each call's two edges (a push and a pop trap when watched), in time order.
    let mut edges: Vec<(u64, i32, usize)> = calls
        .iter()
        .filter(|c| c.probe < probes && c.start_ns >= r.start_ns)
        .flat_map(|c| {
            let t = tids[&c.tid];
            [
                (at(c.start_ns), t, c.probe),
                (at(c.start_ns + c.dur_ns), t, c.probe),
            ]
        })
        .collect();
    edges.sort_unstable();
    let mut pipe = Pipeline::new(Vec::<Event>::new(), base, 100);
    let mut seen: HashSet<(i32, usize)> = HashSet::new();
    let end = at(r.to_ns);
    let tick = r.tick_ns.max(1_000_000);
    let (mut now, mut e) = (base, 0);
    while now < end {
        let next = now + tick;
        // Between two runs of the schedule what is watched stays as it is.
        while e < edges.len() && edges[e].0 < next {
            let (t, tid, i) = edges[e];
            if seen.insert((tid, i)) {
                // The thread is seen running the function (a sample would show it).
                let _ = p.want(&mut k, &proc, tid, i, t.max(now));
            }
            if k.watched(tid, addr(i)) {
                p.note_trap(tid, t);
            }
            e += 1;
        }
        now = next;
        p.drained_to(now);
        p.rotate(&mut k, |_| Some(&proc), now);
    }
    let _ = p.flush_watches(&mut pipe);
    let phases: HashMap<i32, f64> = p.regs.iter().map(|(&t, r)| (t, r.duty())).collect();
    // Watched intervals per (probe, fake tid), clipped to the window.
    let (w0, w1) = (at(r.from_ns), end);
    // Back on the timeline's clock.
    let back = |t: u64| t.saturating_sub(base).saturating_add(r.start_ns);
    let mut open: HashMap<(usize, i32), u64> = HashMap::new();
    let mut intervals: HashMap<(usize, i32), Vec<(u64, u64)>> = HashMap::new();
    for ev in &pipe.writer {
        let Event::ProbeWatch(w) = ev else { continue };
        let key = (w.probe as usize, w.tid);
        let t = base + w.t_ns;
        if w.on {
            open.insert(key, t);
        } else if let Some(a) = open.remove(&key) {
            intervals.entry(key).or_default().push((a, t));
        }
    }
    for (key, a) in open {
        intervals.entry(key).or_default().push((a, end));
    }
    let mut rows: BTreeMap<(usize, i32), Watched> = BTreeMap::new();
    for c in calls.iter().filter(|c| c.probe < probes) {
        let (s, t) = (at(c.start_ns), tids[&c.tid]);
        if s < w0 || s >= w1 {
            continue;
        }
        let row = rows.entry((c.probe, c.tid)).or_insert_with(|| {
            let iv: Vec<(u64, u64)> = intervals
                .get(&(c.probe, t))
                .map_or(&[][..], |v| v)
                .iter()
                .map(|&(a, b)| (back(a.max(w0)), back(b.min(w1))))
                .filter(|(a, b)| b > a)
                .collect();
            Watched {
                probe: c.probe,
                tid: c.tid,
                watched_ns: iv.iter().map(|(a, b)| b - a).sum(),
                intervals: iv,
                phase: phases.get(&t).copied().unwrap_or(1.0),
                ..Watched::default()
            }
        });
        row.all.push(c.dur_ns);
        let whole = intervals
            .get(&(c.probe, t))
            .is_some_and(|iv| iv.iter().any(|&(a, b)| s >= a && s + c.dur_ns <= b));
        if whole {
            row.timed.push((c.start_ns, c.dur_ns));
        }
    }
    rows.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A thread calling one function every 2 ms for 1 ms: watched all the time without a
    /// budget (every call timed, the count exact); under a budget, about its share watched and
    /// the count estimated within a few percent over a long window.
    #[test]
    fn a_steady_thread_is_estimated_from_its_watched_share() {
        let timeline: Vec<Call> = (0..30_000)
            .map(|k| Call {
                probe: 0,
                tid: 42,
                start_ns: 1_000 * MS + k * 2 * MS,
                dur_ns: MS,
            })
            .collect();
        let mut r = Replay {
            budget: 0.0,
            trap_ns: 10_000,
            tick_ns: 20 * MS,
            seed: 7,
            start_ns: 1_000 * MS,
            from_ns: 2_000 * MS,
            to_ns: 60_000 * MS,
        };
        let window = r.to_ns - r.from_ns;
        let rows = replay(1, &timeline, &r);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].all.len(), 29_000);
        assert_eq!(rows[0].timed.len(), 29_000);
        assert_eq!(rows[0].watched_ns, window);
        // 1,000 traps a second at 10 µs: 1% of the thread's time; a 0.1% budget watches a
        // tenth of it.
        r.budget = 0.001;
        let rows = replay(1, &timeline, &r);
        let w = &rows[0];
        let share = w.watched_ns as f64 / window as f64;
        assert!((share - 0.1).abs() < 0.02, "watched {share:.3}");
        assert!((w.phase - 0.1).abs() < 1e-9);
        let (calls, lat) = w.estimate(window).unwrap();
        let err = calls / 29_000.0 - 1.0;
        // One seed, one schedule.
        assert_eq!(replay(1, &timeline, &r)[0], *w);
        assert!((lat.p50 - 1.0).abs() < 1e-9, "{lat:?}");
        assert!(err.abs() < 0.05, "count off by {:.1}%", err * 100.0);
    }
}
