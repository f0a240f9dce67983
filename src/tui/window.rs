//! Sliding-window aggregates over a growing recording, maintained incrementally.
//!
//! The recording grows by about a thousand samples a second per busy thread, so nothing here
//! rescans it: [`Window::update`] reads only the events appended since the last call (index
//! cursors into the recording's vectors) and adds each one into fixed-width time buckets. The
//! window's totals are kept as running sums: a bucket is added when its events arrive and
//! subtracted when it leaves the window, so the work per update is proportional to the new
//! events, and reading the totals costs nothing.
//!
//! The window is whole buckets: the one holding `now` and the `len_buckets - 1` before it, so
//! it spans between `window - bucket` and `window` of time. Intervals (off-CPU, GIL waits, GC
//! pauses) are split across the buckets they overlap and clipped to the window. An event that
//! ends after `now` (live: the recorder wrote it within the display lag) waits in `pending`
//! until `now` passes its end, so no bucket holds time that the window's wall clock has not
//! reached yet.

use std::collections::{HashMap, VecDeque};

pub use crate::accounting::{
    Acc, FnAcc, FnId, FunctionTable, Holder, LockKey, StackKey, Sums, ThreadAcc, ThreadKey,
    TimeCount,
};
use crate::record::{FunctionCall, GcPause, GilWait, MetricPoint, OffCpu, Recording, Sample, Wake};

/// One bucket's sums (crate::accounting: what each event contributes). `functions` stays
/// empty: a bucket keeps its on-CPU time by stack, one map update per sample, and the window's
/// per-function totals follow from those; the window's totals keep no stacks.
#[derive(Debug, Default, Clone)]
struct Bucket {
    index: u64,
    sums: Sums,
    /// Longest GC pause that began here, per (pid, generation): a maximum cannot be taken
    /// out of a running total, so the window's is taken over its buckets.
    gc_max: HashMap<(i32, i8), u64>,
}

/// How far the window has read each of the recording's event vectors.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Cursors {
    pub samples: usize,
    pub offcpu: usize,
    pub gil_waits: usize,
    pub gc_pauses: usize,
    pub calls: usize,
    pub metrics: usize,
    pub wakes: usize,
}

/// Most wake-ups kept per woken thread until the off-CPU interval each ends arrives (a bound
/// on memory; they are also dropped once older than the window).
const WAKES_KEPT: usize = 1 << 16;

/// An event that ends after `now`, kept until `now` reaches its end.
#[derive(Debug, Clone, Copy)]
enum Pending {
    Sample(Sample),
    OffCpu(OffCpu),
    Gil(GilWait),
    Gc(GcPause),
    Call(FunctionCall),
    Metric(MetricPoint),
}

impl Pending {
    fn end_ns(&self) -> u64 {
        match self {
            Pending::Sample(s) => s.t_ns,
            Pending::OffCpu(o) => o.start_ns.saturating_add(o.dur_ns),
            Pending::Gil(g) => g.start_ns.saturating_add(g.dur_ns),
            Pending::Gc(g) => g.start_ns.saturating_add(g.dur_ns),
            Pending::Call(c) => c.start_ns.saturating_add(c.dur_ns),
            Pending::Metric(m) => m.t_ns,
        }
    }
}

/// Most recent call durations kept per (probe, thread) for percentiles: a bound on memory and
/// on the work per snapshot when a probed function is called very often.
pub(crate) const MAX_CALLS_KEPT: usize = 100_000;

/// The sliding window and its running sums.
#[derive(Debug, Clone)]
pub struct Window {
    pub bucket_ns: u64,
    pub len_buckets: u64,
    now_ns: u64,
    /// Contiguous bucket indices, the oldest first; the last holds `now`.
    buckets: VecDeque<Bucket>,
    pub totals: Sums,
    pub fns: FunctionTable,
    /// Per (probe, thread): (end, duration) of the calls in the window, oldest first.
    pub call_durations: HashMap<(u32, ThreadKey), VecDeque<(u64, u64)>>,
    /// Per series: (time, value) over the last `metric_span_ns`.
    pub metric_points: HashMap<u32, VecDeque<(u64, f64)>>,
    pub metric_span_ns: u64,
    /// Last event time per thread (any kind).
    pub last_seen: HashMap<ThreadKey, u64>,
    pub cursors: Cursors,
    pending: Vec<Pending>,
    /// Per woken thread: its wake-ups not yet matched with the off-CPU interval each ends
    /// (`views::waits`), oldest first.
    wakes: HashMap<ThreadKey, VecDeque<Wake>>,
    /// On-CPU time per (thread, stack) that entered (+) or left (-) the window since the
    /// per-function totals were last brought up to date: a stack seen a thousand times in a
    /// tick is expanded into its functions once.
    stack_delta: HashMap<StackKey, (i64, i64)>,
}

impl Window {
    /// A window of `window_ns`, in `buckets` buckets. Metric points are kept for
    /// `metric_span_ns` (at least the window) for sparklines.
    pub fn new(window_ns: u64, buckets: u64, metric_span_ns: u64) -> Self {
        let buckets = buckets.max(1);
        let bucket_ns = window_ns.div_ceil(buckets).max(1);
        Window {
            bucket_ns,
            len_buckets: buckets,
            now_ns: 0,
            buckets: VecDeque::new(),
            totals: Sums::default(),
            fns: FunctionTable::default(),
            call_durations: HashMap::new(),
            metric_points: HashMap::new(),
            metric_span_ns: metric_span_ns.max(bucket_ns * buckets),
            last_seen: HashMap::new(),
            cursors: Cursors::default(),
            pending: Vec::new(),
            wakes: HashMap::new(),
            stack_delta: HashMap::new(),
        }
    }

    /// Everything forgotten, as for a new recording (replay seeking backwards). The function
    /// table is kept: it depends only on the recording's frame table.
    pub(crate) fn reset(&mut self) {
        let fns = std::mem::take(&mut self.fns);
        *self = Window::new(
            self.bucket_ns * self.len_buckets,
            self.len_buckets,
            self.metric_span_ns,
        );
        self.fns = fns;
    }

    pub(crate) fn now_ns(&self) -> u64 {
        self.now_ns
    }

    fn first_bucket(&self) -> u64 {
        (self.now_ns / self.bucket_ns + 1).saturating_sub(self.len_buckets)
    }

    /// Start of the window, ns since the recording's start.
    pub fn start_ns(&self) -> u64 {
        self.first_bucket() * self.bucket_ns
    }

    /// Wall time the window covers: `now - start`.
    pub fn wall_ns(&self) -> u64 {
        self.now_ns - self.start_ns()
    }

    /// Bucket indices and their time in the window, oldest first, for per-bucket histories.
    pub(crate) fn bucket_spans(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.buckets.iter().map(move |b| {
            let start = (b.index * self.bucket_ns).max(self.start_ns());
            let end = ((b.index + 1) * self.bucket_ns).min(self.now_ns);
            (b.index, end.saturating_sub(start))
        })
    }

    /// A thread's on-CPU time per bucket, oldest first.
    pub(crate) fn thread_cpu_history(&self, key: ThreadKey) -> Vec<u64> {
        self.buckets
            .iter()
            .map(|b| b.sums.threads.get(&key).map_or(0, |t| t.cpu_ns))
            .collect()
    }

    /// The longest GC pause per (pid, generation) that began in the window.
    pub(crate) fn gc_max(&self) -> HashMap<(i32, i8), u64> {
        let mut m: HashMap<(i32, i8), u64> = HashMap::new();
        for b in &self.buckets {
            for (&k, &v) in &b.gc_max {
                let e = m.entry(k).or_default();
                *e = (*e).max(v);
            }
        }
        m
    }

    /// Move `now` forward (never back) and drop what left the window.
    fn advance(&mut self, now_ns: u64) {
        self.now_ns = self.now_ns.max(now_ns);
        let first = self.first_bucket();
        while self.buckets.front().is_some_and(|b| b.index < first) {
            if let Some(b) = self.buckets.pop_front() {
                self.totals.sub(&b.sums);
                for (k, tc) in b.sums.stacks {
                    let d = self.stack_delta.entry(k).or_default();
                    d.0 -= tc.ns as i64;
                    d.1 -= tc.count as i64;
                }
            }
        }
        let cur = self.now_ns / self.bucket_ns;
        let mut next = self
            .buckets
            .back()
            .map_or(first, |b| b.index + 1)
            .max(first);
        while next <= cur {
            self.buckets.push_back(Bucket {
                index: next,
                ..Bucket::default()
            });
            next += 1;
        }
        let start = self.start_ns();
        for q in self.call_durations.values_mut() {
            while q.front().is_some_and(|&(end, _)| end < start) {
                q.pop_front();
            }
        }
        self.call_durations.retain(|_, q| !q.is_empty());
        let mstart = self.now_ns.saturating_sub(self.metric_span_ns);
        for q in self.metric_points.values_mut() {
            // Keep one point before the span: a rate over the span needs its left edge.
            while q.len() > 1 && q.get(1).is_some_and(|&(t, _)| t < mstart) {
                q.pop_front();
            }
        }
    }

    /// Position in `buckets` of bucket `index`, if it is in the window.
    fn bucket_pos(&self, index: u64) -> Option<usize> {
        let first = self.buckets.front()?.index;
        let i = usize::try_from(index.checked_sub(first)?).ok()?;
        (i < self.buckets.len()).then_some(i)
    }

    fn bucket_mut(&mut self, index: u64) -> Option<&mut Bucket> {
        let i = self.bucket_pos(index)?;
        self.buckets.get_mut(i)
    }

    /// Split `[start, start + dur)` over the window's buckets: (bucket index, ns in it), the
    /// first piece first. An interval that began in the window always has a first piece (of
    /// 0 ns when it is empty), so that it is counted.
    fn split(&self, start: u64, dur: u64) -> Vec<(u64, u64)> {
        let lo = start.max(self.start_ns());
        let hi = start.saturating_add(dur).min(self.now_ns);
        let mut out = Vec::new();
        let mut t = lo;
        while t < hi {
            let b = t / self.bucket_ns;
            let end = ((b + 1) * self.bucket_ns).min(hi);
            out.push((b, end - t));
            t = end;
        }
        if out.is_empty() && start >= self.start_ns() && start <= self.now_ns {
            out.push((start / self.bucket_ns, 0));
        }
        out
    }

    /// Add a value to bucket `index` and to the totals; nothing when the bucket left the window.
    fn add<F>(&mut self, index: u64, f: F)
    where
        F: Fn(&mut Sums),
    {
        let Some(b) = self.bucket_mut(index) else {
            return;
        };
        f(&mut b.sums);
        f(&mut self.totals);
    }

    fn seen(&mut self, key: ThreadKey, t: u64) {
        let e = self.last_seen.entry(key).or_default();
        *e = (*e).max(t);
    }

    fn ingest_sample(&mut self, s: &Sample) {
        let key = (s.pid, s.tid);
        self.seen(key, s.t_ns);
        let Some(pos) = self.bucket_pos(s.t_ns / self.bucket_ns) else {
            return;
        };
        self.buckets[pos].sums.add_sample(s);
        self.totals
            .threads
            .entry(key)
            .or_default()
            .add(&ThreadAcc::of_sample(s));
        let native = s.flags & crate::record::flags::NATIVE != 0;
        let d = self.stack_delta.entry((key, s.stack, native)).or_default();
        d.0 += i64::from(s.weight_ns);
        d.1 += 1;
    }

    /// Bring the per-function totals up to date with the stacks that entered or left the
    /// window (time and sample counts each with its own sign: a stack's samples entering and
    /// leaving in one tick can move them apart).
    fn apply_stack_deltas(&mut self, rec: &Recording) {
        for ((key, stack, native), (dns, dcount)) in std::mem::take(&mut self.stack_delta) {
            for (tc, enters) in [
                (
                    TimeCount {
                        ns: dns.unsigned_abs(),
                        count: 0,
                    },
                    dns > 0,
                ),
                (
                    TimeCount {
                        ns: 0,
                        count: dcount.unsigned_abs(),
                    },
                    dcount > 0,
                ),
            ] {
                if tc.is_zero() {
                    continue;
                }
                let functions = &mut self.totals.functions;
                self.fns.expand(rec, stack, native, tc, |f, acc| {
                    let e = functions.entry((key, f)).or_default();
                    if enters {
                        e.add(&acc);
                    } else {
                        e.sub(&acc);
                        if e.is_zero() {
                            functions.remove(&(key, f));
                        }
                    }
                });
            }
        }
    }

    fn ingest_offcpu(&mut self, rec: &Recording, o: &OffCpu) {
        let key = (o.pid, o.tid);
        let end = o.start_ns.saturating_add(o.dur_ns);
        self.seen(key, end);
        let lock = if o.preempted {
            None
        } else {
            self.lock_wait(rec, o, end)
        };
        let first = self.start_ns() <= o.start_ns;
        for (i, (b, ns)) in self.split(o.start_ns, o.dur_ns).into_iter().enumerate() {
            self.add(b, |s| s.add_offcpu(o, ns));
            if let Some(k) = lock {
                // Counted once, in its first bucket, when it began in the window.
                let count = u64::from(i == 0 && first);
                self.add(b, |s| s.add_lock_wait(k, ns, count));
            }
        }
    }

    /// The lock wait a blocked interval was, if a wake-up of its thread by another ends it and
    /// it waited in the thread's own code (`views::waits`); drops the thread's older wake-ups.
    fn lock_wait(&mut self, rec: &Recording, o: &OffCpu, end: u64) -> Option<LockKey> {
        let ws = self.wakes.get_mut(&(o.pid, o.tid))?;
        while ws.front().is_some_and(|w| w.t_ns < o.start_ns) {
            ws.pop_front();
        }
        let i = ws.partition_point(|w| w.t_ns <= end).checked_sub(1)?;
        let w = ws[i];
        ws.drain(..=i);
        let waiter = self.fns.innermost_where(rec, o.stack, |_, _| true);
        let (function, file) = waiter.map(|f| self.fns.name(f)).unwrap_or(("", ""));
        if crate::views::waits::is_event_wait(function, file) {
            return None;
        }
        let waker = self.fns.innermost_where(rec, w.waker_stack, |_, file| {
            !crate::views::waits::is_wait_machinery(file)
        });
        Some(((o.pid, o.tid), waiter, w.waker_tid, waker))
    }

    fn ingest_gil(&mut self, rec: &Recording, g: &GilWait) {
        let key = (g.pid, g.tid);
        self.seen(key, g.start_ns.saturating_add(g.dur_ns));
        let holder = self.fns.holder(rec, g);
        let first = self.start_ns() <= g.start_ns;
        for (i, (b, ns)) in self.split(g.start_ns, g.dur_ns).into_iter().enumerate() {
            // A wait is counted once, in its first bucket, and only when it began in the window.
            let count = u64::from(i == 0 && first);
            self.add(b, |s| s.add_gil_wait(g, holder, ns, count));
        }
    }

    fn ingest_gc(&mut self, g: &GcPause) {
        let key = (g.pid, g.tid);
        self.seen(key, g.start_ns.saturating_add(g.dur_ns));
        let first = self.start_ns() <= g.start_ns;
        for (i, (b, ns)) in self.split(g.start_ns, g.dur_ns).into_iter().enumerate() {
            let count = u64::from(i == 0 && first);
            self.add(b, |s| s.add_gc_pause(g, ns, count));
        }
        if first {
            if let Some(b) = self.bucket_mut(g.start_ns / self.bucket_ns) {
                let m = b.gc_max.entry((g.pid, g.generation)).or_default();
                *m = (*m).max(g.dur_ns);
            }
        }
    }

    fn ingest_call(&mut self, c: &FunctionCall) {
        let end = c.start_ns.saturating_add(c.dur_ns);
        if end < self.start_ns() {
            return;
        }
        let key = (c.probe, (c.pid, c.tid));
        self.add(end / self.bucket_ns, |s| s.add_call(c));
        let q = self.call_durations.entry(key).or_default();
        q.push_back((end, c.dur_ns));
        if q.len() > MAX_CALLS_KEPT {
            q.pop_front();
        }
    }

    fn ingest_metric(&mut self, m: &MetricPoint) {
        if m.t_ns + self.metric_span_ns < self.now_ns {
            return;
        }
        let q = self.metric_points.entry(m.series).or_default();
        // Points of one series come in time order; one out of order is placed where it belongs.
        let at = q.partition_point(|&(t, _)| t <= m.t_ns);
        q.insert(at, (m.t_ns, m.value));
    }

    fn ingest(&mut self, rec: &Recording, e: Pending) {
        match e {
            Pending::Sample(s) => self.ingest_sample(&s),
            Pending::OffCpu(o) => self.ingest_offcpu(rec, &o),
            Pending::Gil(g) => self.ingest_gil(rec, &g),
            Pending::Gc(g) => self.ingest_gc(&g),
            Pending::Call(c) => self.ingest_call(&c),
            Pending::Metric(m) => self.ingest_metric(&m),
        }
    }

    fn offer(&mut self, rec: &Recording, e: Pending) {
        if e.end_ns() <= self.now_ns {
            self.ingest(rec, e);
        } else {
            self.pending.push(e);
        }
    }

    /// Move the window to `now_ns` and take in every event appended to `rec` since the last
    /// call. Events that end after `now` are held back until it reaches them.
    pub fn update(&mut self, rec: &Recording, now_ns: u64) {
        self.advance(now_ns);
        self.fns.sync(rec);
        for e in std::mem::take(&mut self.pending) {
            self.offer(rec, e);
        }
        let c = self.cursors;
        // Wake-ups first: each ends an off-CPU interval written after it. Those older than the
        // window end no interval it counts.
        let old = self.start_ns().saturating_sub(self.bucket_ns);
        self.wakes.retain(|_, q| {
            while q.front().is_some_and(|w| w.t_ns < old) {
                q.pop_front();
            }
            !q.is_empty()
        });
        for w in rec.wakes.get(c.wakes..).unwrap_or(&[]) {
            let q = self.wakes.entry((w.pid, w.tid)).or_default();
            q.push_back(*w);
            if q.len() > WAKES_KEPT {
                q.pop_front();
            }
        }
        for s in rec.samples.get(c.samples..).unwrap_or(&[]) {
            self.offer(rec, Pending::Sample(*s));
        }
        for o in rec.offcpu.get(c.offcpu..).unwrap_or(&[]) {
            self.offer(rec, Pending::OffCpu(*o));
        }
        for g in rec.gil_waits.get(c.gil_waits..).unwrap_or(&[]) {
            self.offer(rec, Pending::Gil(*g));
        }
        for g in rec.gc_pauses.get(c.gc_pauses..).unwrap_or(&[]) {
            self.offer(rec, Pending::Gc(*g));
        }
        for x in rec.calls.get(c.calls..).unwrap_or(&[]) {
            self.offer(rec, Pending::Call(*x));
        }
        for m in rec.metrics.get(c.metrics..).unwrap_or(&[]) {
            self.offer(rec, Pending::Metric(*m));
        }
        self.apply_stack_deltas(rec);
        self.cursors = Cursors {
            samples: rec.samples.len(),
            offcpu: rec.offcpu.len(),
            gil_waits: rec.gil_waits.len(),
            gc_pauses: rec.gc_pauses.len(),
            calls: rec.calls.len(),
            metrics: rec.metrics.len(),
            wakes: rec.wakes.len(),
        };
    }

    /// Drop events that ended before `now - keep_ns` from the front of the recording's event
    /// vectors (the window has read them; views of the last seconds do not need them), so a
    /// long live session keeps bounded memory. Only a read prefix is dropped.
    pub fn trim(&mut self, rec: &mut Recording, keep_ns: u64) {
        let cutoff = self.now_ns.saturating_sub(keep_ns.max(self.metric_span_ns));
        fn drop_prefix<T>(v: &mut Vec<T>, cursor: &mut usize, old: impl Fn(&T) -> bool) {
            let n = v[..(*cursor).min(v.len())]
                .iter()
                .position(|e| !old(e))
                .unwrap_or((*cursor).min(v.len()));
            if n > 0 {
                v.drain(..n);
                *cursor -= n;
            }
        }
        let c = &mut self.cursors;
        drop_prefix(&mut rec.samples, &mut c.samples, |s| s.t_ns < cutoff);
        drop_prefix(&mut rec.offcpu, &mut c.offcpu, |o| {
            o.start_ns.saturating_add(o.dur_ns) < cutoff
        });
        drop_prefix(&mut rec.gil_waits, &mut c.gil_waits, |g| {
            g.start_ns.saturating_add(g.dur_ns) < cutoff
        });
        drop_prefix(&mut rec.wakes, &mut c.wakes, |w| w.t_ns < cutoff);
        drop_prefix(&mut rec.gc_pauses, &mut c.gc_pauses, |g| {
            g.start_ns.saturating_add(g.dur_ns) < cutoff
        });
        drop_prefix(&mut rec.calls, &mut c.calls, |x| {
            x.start_ns.saturating_add(x.dur_ns) < cutoff
        });
        drop_prefix(&mut rec.metrics, &mut c.metrics, |m| m.t_ns < cutoff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{flags, Frame};

    fn frame(function: &str) -> Frame {
        Frame {
            function: function.into(),
            file: "a.py".into(),
            line: Some(1),
        }
    }

    /// The window's running sums, slid over a recording in steps, equal the same accounting
    /// done afresh over the samples inside the window at every step: per thread and per
    /// function (time and samples, self, native and total), with stacks entering and leaving.
    #[test]
    fn running_sums_equal_a_fresh_sum_of_the_window_at_every_step() {
        const MS: u64 = 1_000_000;
        let mut rec = Recording {
            frames: vec![frame("main"), frame("f"), frame("g"), frame("h")],
            // main > f; main > f > g; main > g > f > g (recursion); main > h
            stacks: vec![vec![1, 0], vec![2, 1, 0], vec![2, 1, 2, 0], vec![3, 0]],
            ..Recording::default()
        };
        // A deterministic mix: two threads, every stack, some native, weights that vary.
        let mut x: u64 = 12345;
        for i in 0..3000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            rec.samples.push(Sample {
                t_ns: i * 3 * MS + (x >> 60),
                pid: 1,
                tid: 1 + (x >> 33) as i32 % 2,
                stack: ((x >> 40) % 4) as u32,
                flags: if (x >> 50).is_multiple_of(3) {
                    flags::NATIVE
                } else {
                    0
                },
                weight_ns: 1_000_000 + ((x >> 20) % 1000) as u32,
            });
        }
        let mut w = Window::new(1000 * MS, 4, 0);
        let mut now = 0;
        while now < 9500 * MS {
            now += 170 * MS;
            w.update(&rec, now);
            let mut fresh = Sums::default();
            let mut table = FunctionTable::of(&rec);
            for s in &rec.samples {
                if (w.start_ns()..=now).contains(&s.t_ns) {
                    fresh.add_sample(s);
                }
            }
            fresh.expand_stacks(&rec, &mut table);
            assert_eq!(w.totals.threads, fresh.threads, "threads at {now}");
            assert_eq!(w.totals.functions, fresh.functions, "functions at {now}");
        }
    }
}
