//! Aggregated events: what an always-on recorder (`enginescope agent`) stores instead of one
//! record per sample, context switch, GIL wait and probed call (docs/recording-format.md,
//! "Aggregated intervals").
//!
//! Over each interval (`--profile-seconds`, 10 s by default) the writer adds events up by key:
//! samples by (thread, stack, flags) into a count and a CPU-time sum, off-CPU intervals by
//! (thread, stack, preempted) and GIL waits by (thread, holder, holder's stack, waiter's stack,
//! switch wait) into a count and a duration sum, and probed calls by (thread, probe) and GC
//! pauses by (thread, generation) into a count, a duration sum and a histogram of log-linear
//! buckets ([`bucket`]; pauses read back scaled to their exact sum, [`hist_durations`]). At
//! the interval's end it writes one interval record and one record per key. Sums and counts are exact (the
//! per-thread CPU, GIL held, GIL wait, off-CPU and GC figures, the flamegraphs and the per-stack
//! off-CPU time read the same as from raw events); what is lost is each event's own time within
//! the interval and, for calls, the exact duration: a call's duration is known to within its
//! bucket, whose midpoint is at most 1/64 (1.6 %) of the value away from it ([`MAX_REL_ERROR`]),
//! so every quantile of the calls is too.
//!
//! Threads whose events views need one by one keep raw records: an API server's event-loop
//! thread (its main thread) and every thread seen running an asyncio task (`report`'s
//! stalls are runs of samples between off-CPU intervals) keep their samples, their off-CPU
//! intervals of at least [`LOOP_RAW_MIN_OFFCPU_NS`] and their GIL waits of at least half of it.

use std::collections::HashMap;

/// How a writer aggregates ([`super::RecordingWriter::aggregate`]).
#[derive(Clone, Copy)]
pub struct AggregateOptions {
    /// Length of an interval, ns.
    pub interval_ns: u64,
    /// The role of processes whose main thread runs an event loop (vLLM's API server): their
    /// main thread's events stay raw.
    pub event_loop_role: &'static str,
    /// The engine metric series kept (by sample name), in a rotating recording.
    pub keep_series: fn(&str) -> bool,
}

/// An event-loop thread's off-CPU intervals at least this long stay raw (shorter ones and its
/// GIL waits under half of it are added up like everyone's): `report`'s stalls end a run of
/// samples only at a blocked interval longer than `views::stalls::MAX_BLOCK_NS` (checked
/// there), and an API server under load switches ~650 times a second, 92 % of them shorter.
pub(crate) const LOOP_RAW_MIN_OFFCPU_NS: u64 = 2_000_000;

/// Sub-buckets per power of two: bucket width is 1/32 of the octave's start, so a bucket's
/// midpoint is within 1/64 of any value in it.
const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;

/// The most a call duration read back from an aggregated record differs from the real one,
/// relative to it (and so the error bound of every quantile of calls).
pub const MAX_REL_ERROR: f64 = 1.0 / 64.0;

/// Log-linear bucket of a duration in ns: exact below 32 ns, then 32 buckets per power of two.
pub fn bucket(ns: u64) -> u32 {
    if ns < SUB {
        return ns as u32;
    }
    let k = 63 - ns.leading_zeros(); // floor(log2 ns) >= SUB_BITS
    let sub = (ns >> (k - SUB_BITS)) - SUB; // 0..SUB
    ((k - SUB_BITS + 1) as u64 * SUB + sub) as u32
}

/// The value a bucket stands for: its midpoint (its value below 32 ns, where buckets are exact).
pub(crate) fn bucket_value(b: u32) -> u64 {
    let b = b as u64;
    if b < SUB {
        return b;
    }
    let octave = b / SUB - 1; // k - SUB_BITS
    let sub = b % SUB;
    let Some(low) = (SUB + sub).checked_shl(octave as u32) else {
        return u64::MAX;
    };
    let width = 1u64.checked_shl(octave as u32).unwrap_or(u64::MAX);
    low.saturating_add(width / 2)
}

/// A count and a sum (ns).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CountSum {
    pub count: u64,
    pub sum_ns: u64,
}

impl CountSum {
    fn add(&mut self, ns: u64) {
        self.count += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct SampleKey {
    pub pid: i32,
    pub tid: i32,
    pub stack: u32,
    pub flags: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct OffCpuKey {
    pub pid: i32,
    pub tid: i32,
    pub stack: u32,
    pub preempted: bool,
    /// Taken by the hypervisor while on CPU (`OffCpu::stolen`).
    pub stolen: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct GilKey {
    pub pid: i32,
    pub tid: i32,
    pub holder_tid: i32,
    pub holder_stack: u32,
    pub waiter_stack: u32,
    pub switch_wait: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct CallKey {
    pub pid: i32,
    pub tid: i32,
    pub probe: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct GcKey {
    pub pid: i32,
    pub tid: i32,
    /// -1: unknown.
    pub generation: i8,
}

/// Collections of one generation on one thread over an interval: the pauses' durations (as a
/// probe's calls), and the objects they freed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GcHist {
    pub pauses: DurationHist,
    /// Objects freed by the pauses that know it; -1 when none does.
    pub collected: i64,
}

/// Durations of `count` events read back from a histogram whose exact sum is `sum_ns`: each
/// its bucket's value, scaled so that they add up to the sum exactly (the last takes what
/// rounding leaves), so that per-thread GC time reads as from raw events.
pub(crate) fn hist_durations(buckets: &[(u32, u64)], sum_ns: u64) -> Vec<u64> {
    let vals: Vec<u64> = buckets
        .iter()
        .flat_map(|&(b, n)| std::iter::repeat_n(bucket_value(b), n as usize))
        .collect();
    let approx: u128 = vals.iter().map(|&v| u128::from(v)).sum();
    if approx == 0 {
        return vals;
    }
    let mut out: Vec<u64> = vals
        .iter()
        .map(|&v| (u128::from(v) * u128::from(sum_ns) / approx) as u64)
        .collect();
    let given: u64 = out.iter().sum();
    if let Some(last) = out.last_mut() {
        *last = last.saturating_add(sum_ns.saturating_sub(given));
    }
    out
}

/// Durations over an interval (a probe's calls on one thread, a thread's collections of one
/// generation): count, exact sum, and the histogram.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DurationHist {
    pub count: u64,
    pub sum_ns: u64,
    /// (bucket, count), buckets ascending.
    pub buckets: Vec<(u32, u64)>,
}

/// Durations added up so far: per [`bucket`] the count, and the exact sum.
#[derive(Default)]
pub(crate) struct Durations {
    buckets: HashMap<u32, u64>,
    sum_ns: u64,
}

impl Durations {
    fn add(&mut self, ns: u64) {
        *self.buckets.entry(bucket(ns)).or_default() += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }

    fn hist(&self) -> DurationHist {
        let mut buckets: Vec<(u32, u64)> = self.buckets.iter().map(|(&b, &n)| (b, n)).collect();
        buckets.sort_unstable();
        DurationHist {
            count: buckets.iter().map(|b| b.1).sum(),
            sum_ns: self.sum_ns,
            buckets,
        }
    }
}

/// One key's collections so far: their durations, and the objects freed (None: unknown in
/// every pause).
#[derive(Default)]
pub(crate) struct GcAcc {
    pauses: Durations,
    collected: Option<i64>,
}

/// Each key's figure (`f` of its value), keys in order.
fn by_key<K: Copy + Ord, V, H>(m: &HashMap<K, V>, f: impl Fn(&V) -> H) -> Vec<(K, H)> {
    let mut out: Vec<(K, H)> = m.iter().map(|(k, v)| (*k, f(v))).collect();
    out.sort_unstable_by_key(|(k, _)| *k);
    out
}

/// Events of the current interval, added up by key.
#[derive(Default)]
pub(crate) struct Accumulator {
    pub samples: HashMap<SampleKey, CountSum>,
    pub offcpu: HashMap<OffCpuKey, CountSum>,
    pub gil: HashMap<GilKey, CountSum>,
    pub calls: HashMap<CallKey, Durations>,
    pub gc: HashMap<GcKey, GcAcc>,
}

impl Accumulator {
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
            && self.offcpu.is_empty()
            && self.gil.is_empty()
            && self.calls.is_empty()
            && self.gc.is_empty()
    }
    pub fn sample(&mut self, k: SampleKey, weight_ns: u64) {
        self.samples.entry(k).or_default().add(weight_ns);
    }
    pub fn offcpu(&mut self, k: OffCpuKey, dur_ns: u64) {
        self.offcpu.entry(k).or_default().add(dur_ns);
    }
    pub fn gil(&mut self, k: GilKey, dur_ns: u64) {
        self.gil.entry(k).or_default().add(dur_ns);
    }
    pub fn call(&mut self, k: CallKey, dur_ns: u64) {
        self.calls.entry(k).or_default().add(dur_ns);
    }

    pub fn gc_pause(&mut self, k: GcKey, dur_ns: u64, collected: i64) {
        let e = self.gc.entry(k).or_default();
        e.pauses.add(dur_ns);
        if collected >= 0 {
            e.collected = Some(e.collected.unwrap_or(0).saturating_add(collected));
        }
    }

    /// The collections added up, keys in order.
    pub(crate) fn gc_hists(&self) -> Vec<(GcKey, GcHist)> {
        by_key(&self.gc, |a| GcHist {
            pauses: a.pauses.hist(),
            collected: a.collected.unwrap_or(-1),
        })
    }

    /// The calls added up, keys in order.
    pub(crate) fn call_hists(&self) -> Vec<(CallKey, DurationHist)> {
        by_key(&self.calls, Durations::hist)
    }
}

/// `count` event times spread evenly over `[start, end)` (midpoints of equal parts), for
/// events read back from an aggregated record.
pub fn spread(start: u64, end: u64, count: u64, i: u64) -> u64 {
    let span = end.saturating_sub(start) as u128;
    let c = count.max(1) as u128;
    start + ((2 * i as u128 + 1) * span / (2 * c)) as u64
}

/// When the `i`th of `count` events that ended in `[start, end)` began, read back from an
/// aggregated record: events are written when they end, so each ends where its equal part of
/// the interval ends and lasted `dur_ns` before it (a long block split at a rotation, alone in
/// its interval, keeps its real start).
pub(crate) fn ended_by(start: u64, end: u64, count: u64, i: u64, dur_ns: u64) -> u64 {
    let span = end.saturating_sub(start) as u128;
    let c = count.max(1) as u128;
    let end_i = start + ((i as u128 + 1) * span / c) as u64;
    end_i.saturating_sub(dur_ns)
}

/// `total` split into `count` parts that differ by at most 1 and add up to it exactly.
pub fn part(total: u64, count: u64, i: u64) -> u64 {
    let c = count.max(1);
    total / c + u64::from(i < total % c)
}

/// Write `rec` (a raw recording) to `out` in the aggregated form, as an aggregating recorder
/// would have written it: tables first, then the events in time order, each interval closed
/// at the first event past its end (`enginescope aggregate`; the tests compare views of the
/// two). Returns the bytes written.
pub(crate) fn write_aggregated(
    rec: &super::Recording,
    out: &std::path::Path,
    opts: AggregateOptions,
) -> anyhow::Result<u64> {
    use super::RecordingWriter;
    let mut w = RecordingWriter::create(out, &rec.meta)?;
    w.aggregate(opts);
    for p in &rec.processes {
        w.process(p)?;
    }
    for t in &rec.threads {
        w.thread(t)?;
    }
    for e in &rec.engines {
        w.engine(e)?;
    }
    // Stacks keep their ids: the table is written in order (stack 0, the empty one, exists).
    for (id, ids) in rec.stacks.iter().enumerate().skip(1) {
        let frames: Vec<(super::Frame, Option<super::NativeFrameInfo>)> = ids
            .iter()
            .filter_map(|&f| {
                let fr = rec.frames.get(f as usize)?;
                Some((fr.clone(), rec.frame_native.get(&f).cloned()))
            })
            .collect();
        let got = w.intern_mixed(&frames)?;
        anyhow::ensure!(
            got as usize == id,
            "stack {id} is a duplicate of stack {got}: not a table this writer made"
        );
    }
    for s in &rec.series {
        w.series(s)?;
    }
    for p in &rec.probes {
        w.probe(p)?;
    }
    // Loop threads are known before their events (their events stay raw).
    for t in &rec.task_changes {
        w.task_change(t)?;
    }
    enum Ev<'a> {
        S(&'a super::Sample),
        O(&'a super::OffCpu),
        G(&'a super::GilWait),
        W(&'a super::Wake),
        P(&'a super::GcPause),
        C(&'a super::FunctionCall),
        M(&'a super::MetricPoint),
        E(&'a super::ScrapeError),
    }
    // Events at the time the recorder wrote them: samples and points when taken, intervals
    // and calls when they ended.
    let mut evs: Vec<(u64, Ev)> = Vec::new();
    evs.extend(rec.samples.iter().map(|s| (s.t_ns, Ev::S(s))));
    evs.extend(rec.offcpu.iter().map(|o| (o.start_ns + o.dur_ns, Ev::O(o))));
    evs.extend(
        rec.gil_waits
            .iter()
            .map(|g| (g.start_ns + g.dur_ns, Ev::G(g))),
    );
    evs.extend(rec.wakes.iter().map(|w| (w.t_ns, Ev::W(w))));
    evs.extend(
        rec.gc_pauses
            .iter()
            .map(|g| (g.start_ns + g.dur_ns, Ev::P(g))),
    );
    evs.extend(rec.calls.iter().map(|c| (c.start_ns + c.dur_ns, Ev::C(c))));
    evs.extend(rec.metrics.iter().map(|m| (m.t_ns, Ev::M(m))));
    evs.extend(rec.scrape_errors.iter().map(|e| (e.t_ns, Ev::E(e))));
    evs.sort_by_key(|(t, _)| *t);
    for (t, ev) in evs {
        w.profile_tick(t)?;
        match ev {
            Ev::S(s) => w.sample(s)?,
            Ev::O(o) => w.offcpu(o)?,
            Ev::G(g) => w.gil_wait(g)?,
            Ev::W(x) => w.wake(x)?,
            Ev::P(g) => w.gc_pause(g)?,
            Ev::C(c) => w.call(c)?,
            Ev::M(m) => w.metric(m)?,
            Ev::E(e) => w.scrape_error(e)?,
        }
    }
    w.counters(&rec.counters)?;
    let end = rec.end.clone().unwrap_or_else(|| super::EndInfo {
        duration_ns: rec.duration_ns(),
        reason: "cut short".into(),
    });
    w.finish(&end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gc_pauses_read_back_add_up_to_their_exact_sum() {
        let mut a = Accumulator::default();
        let k = GcKey {
            pid: 1,
            tid: 1,
            generation: 0,
        };
        let pauses = [1_000u64, 1_234, 50_000, 999_999, 7];
        for (i, &p) in pauses.iter().enumerate() {
            a.gc_pause(k, p, if i == 0 { -1 } else { 10 });
        }
        let (
            _,
            GcHist {
                pauses: h,
                collected,
            },
        ) = a.gc_hists().remove(0);
        assert_eq!((h.count, h.sum_ns, collected), (5, pauses.iter().sum(), 40));
        let back = hist_durations(&h.buckets, h.sum_ns);
        assert_eq!(back.iter().sum::<u64>(), h.sum_ns);
        // Each within its bucket's bound and the scaling's (together under 2/64).
        let mut sorted = pauses;
        sorted.sort_unstable();
        for (b, p) in back.iter().zip(sorted) {
            assert!(
                (*b as f64 - p as f64).abs() <= 2.0 * MAX_REL_ERROR * p as f64 + 1.0,
                "{b} vs {p}"
            );
        }
        // No pause knows what it freed: unknown.
        let mut a = Accumulator::default();
        a.gc_pause(k, 5, -1);
        assert_eq!(a.gc_hists()[0].1.collected, -1);
    }

    #[test]
    fn buckets_are_monotone_and_their_midpoints_within_the_bound() {
        for x in 1..200_000u64 {
            assert!(bucket(x) >= bucket(x - 1), "monotone at {x}");
        }
        let mut v = 1u64;
        while v < 1u64 << 50 {
            for x in [v, v + v / 3, v + v / 2, 2 * v - 1] {
                let b = bucket(x);
                let rep = bucket_value(b);
                let err = (rep as f64 - x as f64).abs() / x as f64;
                assert!(err <= MAX_REL_ERROR, "{x}: bucket {b} -> {rep} ({err})");
                assert_eq!(bucket(rep), b, "the midpoint of {b} lies in it");
            }
            v *= 2;
        }
        // Exact below 32 ns; adjacent values at bucket edges.
        assert_eq!(bucket_value(bucket(31)), 31);
        assert_eq!(bucket(32) + 1, bucket(33));
        assert_eq!(bucket(63) + 1, bucket(64));
        assert_eq!(bucket(64), bucket(65));
    }

    #[test]
    fn spread_and_part_add_up() {
        let total: u64 = (0..7).map(|i| part(100, 7, i)).sum();
        assert_eq!(total, 100);
        let t: Vec<u64> = (0..4).map(|i| spread(0, 100, 4, i)).collect();
        assert_eq!(t, [12, 37, 62, 87]);
    }
}
