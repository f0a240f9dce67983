//! One accounting of the recorded event stream, shared by every view that sums it: `report`
//! (over a whole recording or a selection), `top` (per bucket of a sliding window, added and
//! taken out again) and the agent (per scrape interval, into Prometheus counters).
//!
//! What an event contributes is decided here once: a sample's weight is on-CPU time, of which
//! native (the NATIVE flag), GIL held (GIL) and during a collection (GC); an off-CPU interval
//! is off-CPU time, of which preempted; a GIL wait is GIL wait time and one wait (blamed on its
//! holder thread and what that thread ran when the wait began), or, for a forced-switch
//! handshake, switch-wait time and no wait; a GC pause is collection time and one pause; a
//! probed call is one call of its probe on its thread. A view chooses only the span it sums
//! (a window clips an interval to its buckets, and counts an event once, in the bucket where it
//! began) and how it shows the sums.
//!
//! Per-function time follows from per-stack time: a stack's time goes to its innermost
//! function as self time and once to every distinct function on it as total time (recursion
//! counted once), with functions as (qualified name, file), lines merged ([`FunctionTable`]).

use std::collections::HashMap;

use crate::record::{flags, FunctionCall, GcPause, GilWait, OffCpu, Recording, Sample};

/// (pid, tid).
pub type ThreadKey = (i32, i32);
/// Index into [`FunctionTable`]: a function is (qualified name, file), lines merged.
pub type FnId = u32;

/// Running sums that can be added and taken out again.
pub trait Acc: Default + Copy {
    fn add(&mut self, o: &Self);
    fn sub(&mut self, o: &Self);
    fn is_zero(&self) -> bool;
}

/// Per-thread time sums, ns.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ThreadAcc {
    /// On-CPU sample weight.
    pub cpu_ns: u64,
    /// Of which outside the interpreter core (NATIVE flag).
    pub native_ns: u64,
    /// Of which with the GIL held (GIL flag).
    pub gil_held_ns: u64,
    /// Of which during a garbage collection (GC flag).
    pub gc_cpu_ns: u64,
    pub samples: u64,
    /// Off-CPU intervals (blocked or preempted).
    pub off_ns: u64,
    /// Of which preempted (runnable, not blocked).
    pub off_preempted_ns: u64,
    /// Of which taken by the hypervisor while on CPU (`OffCpu::stolen`; part of preempted).
    pub off_stolen_ns: u64,
    /// Exact GIL waits (not switch waits).
    pub gil_wait_ns: u64,
    /// GIL waits counted (each once, where it began).
    pub gil_waits: u64,
    /// Forced-switch handshakes (a dropping thread waiting for the taker).
    pub switch_wait_ns: u64,
    /// Collections this thread ran (exact pauses).
    pub gc_ns: u64,
    pub gc_pauses: u64,
}

impl ThreadAcc {
    /// What one sample contributes.
    pub(crate) fn of_sample(s: &Sample) -> Self {
        let w = u64::from(s.weight_ns);
        let part = |flag: u8| if s.flags & flag != 0 { w } else { 0 };
        ThreadAcc {
            cpu_ns: w,
            native_ns: part(flags::NATIVE),
            gil_held_ns: part(flags::GIL),
            gc_cpu_ns: part(flags::GC),
            samples: 1,
            ..ThreadAcc::default()
        }
    }

    /// What `ns` of an off-CPU interval contributes.
    pub(crate) fn of_offcpu(o: &OffCpu, ns: u64) -> Self {
        ThreadAcc {
            off_ns: ns,
            off_preempted_ns: if o.preempted { ns } else { 0 },
            off_stolen_ns: if o.stolen { ns } else { 0 },
            ..ThreadAcc::default()
        }
    }

    /// What `ns` of a GIL wait contributes, `count` 1 where the wait is counted.
    pub(crate) fn of_gil_wait(g: &GilWait, ns: u64, count: u64) -> Self {
        if g.switch_wait {
            ThreadAcc {
                switch_wait_ns: ns,
                ..ThreadAcc::default()
            }
        } else {
            ThreadAcc {
                gil_wait_ns: ns,
                gil_waits: count,
                ..ThreadAcc::default()
            }
        }
    }

    /// What `ns` of a GC pause contributes, `count` 1 where the pause is counted.
    pub(crate) fn of_gc_pause(ns: u64, count: u64) -> Self {
        ThreadAcc {
            gc_ns: ns,
            gc_pauses: count,
            ..ThreadAcc::default()
        }
    }
}

impl Acc for ThreadAcc {
    fn add(&mut self, o: &Self) {
        self.cpu_ns += o.cpu_ns;
        self.native_ns += o.native_ns;
        self.gil_held_ns += o.gil_held_ns;
        self.gc_cpu_ns += o.gc_cpu_ns;
        self.samples += o.samples;
        self.off_ns += o.off_ns;
        self.off_preempted_ns += o.off_preempted_ns;
        self.off_stolen_ns += o.off_stolen_ns;
        self.gil_wait_ns += o.gil_wait_ns;
        self.gil_waits += o.gil_waits;
        self.switch_wait_ns += o.switch_wait_ns;
        self.gc_ns += o.gc_ns;
        self.gc_pauses += o.gc_pauses;
    }
    fn sub(&mut self, o: &Self) {
        self.cpu_ns -= o.cpu_ns;
        self.native_ns -= o.native_ns;
        self.gil_held_ns -= o.gil_held_ns;
        self.gc_cpu_ns -= o.gc_cpu_ns;
        self.samples -= o.samples;
        self.off_ns -= o.off_ns;
        self.off_preempted_ns -= o.off_preempted_ns;
        self.off_stolen_ns -= o.off_stolen_ns;
        self.gil_wait_ns -= o.gil_wait_ns;
        self.gil_waits -= o.gil_waits;
        self.switch_wait_ns -= o.switch_wait_ns;
        self.gc_ns -= o.gc_ns;
        self.gc_pauses -= o.gc_pauses;
    }
    fn is_zero(&self) -> bool {
        *self == ThreadAcc::default()
    }
}

/// A function's on-CPU time in one thread: innermost (self) and anywhere on the stack (total,
/// once per sample even when recursive).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FnAcc {
    pub self_ns: u64,
    /// Of the self time, samples with the NATIVE flag.
    pub self_native_ns: u64,
    pub total_ns: u64,
    pub self_samples: u64,
    pub total_samples: u64,
}

impl Acc for FnAcc {
    fn add(&mut self, o: &Self) {
        self.self_ns += o.self_ns;
        self.self_native_ns += o.self_native_ns;
        self.total_ns += o.total_ns;
        self.self_samples += o.self_samples;
        self.total_samples += o.total_samples;
    }
    fn sub(&mut self, o: &Self) {
        self.self_ns -= o.self_ns;
        self.self_native_ns -= o.self_native_ns;
        self.total_ns -= o.total_ns;
        self.self_samples -= o.self_samples;
        self.total_samples -= o.total_samples;
    }
    fn is_zero(&self) -> bool {
        *self == FnAcc::default()
    }
}

/// Time and count (a stack's samples, GIL waits by holder, calls, GC pauses).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TimeCount {
    pub ns: u64,
    pub count: u64,
}

impl Acc for TimeCount {
    fn add(&mut self, o: &Self) {
        self.ns += o.ns;
        self.count += o.count;
    }
    fn sub(&mut self, o: &Self) {
        self.ns -= o.ns;
        self.count -= o.count;
    }
    fn is_zero(&self) -> bool {
        self.ns == 0 && self.count == 0
    }
}

/// What the GIL holder was running when a wait began (see `views::gil::HolderFrame`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Holder {
    /// No thread held it (`holder_tid` 0).
    Free,
    /// The waiter held it itself and was releasing it.
    Releasing,
    /// A holder with no Python frame.
    Unknown,
    /// The holder's innermost Python function.
    Function(FnId),
}

/// A stack's on-CPU time in one thread: (thread, stack, whether the samples were native).
pub type StackKey = (ThreadKey, u32, bool);

/// Everything summed over one span (a recording, a window, one of its buckets).
#[derive(Debug, Default, Clone)]
pub struct Sums {
    pub threads: HashMap<ThreadKey, ThreadAcc>,
    /// On-CPU time and samples per stack; the per-function sums follow from these.
    pub stacks: HashMap<StackKey, TimeCount>,
    /// Per-function sums where a view keeps them (see [`FunctionTable::expand`]).
    pub functions: HashMap<(ThreadKey, FnId), FnAcc>,
    /// (waiter, holder tid, holder function) -> wait (switch waits not included).
    pub blame: HashMap<(ThreadKey, i32, Holder), TimeCount>,
    /// (pid, generation) -> pause time and count.
    pub gc: HashMap<(i32, i8), TimeCount>,
    /// (probe, caller thread) -> calls that ended in the span.
    pub calls: HashMap<(u32, ThreadKey), TimeCount>,
    /// (waiter, where it waited, waker tid, what the waker left) -> sleep on a lock another
    /// thread released (`views::waits`' `lock` kind; the live window's only).
    pub lock_waits: HashMap<LockKey, TimeCount>,
}

/// A lock wait's (waiter, its innermost function, waker tid, the waker's function).
pub type LockKey = (ThreadKey, Option<FnId>, i32, Option<FnId>);

fn sub_from<K: Copy + Eq + std::hash::Hash, V: Acc>(total: &mut HashMap<K, V>, m: &HashMap<K, V>) {
    for (k, v) in m {
        if let Some(t) = total.get_mut(k) {
            t.sub(v);
            if t.is_zero() {
                total.remove(k);
            }
        }
    }
}

impl Sums {
    /// A sample (always wholly in the span it is added to).
    pub(crate) fn add_sample(&mut self, s: &Sample) {
        let key = (s.pid, s.tid);
        self.threads
            .entry(key)
            .or_default()
            .add(&ThreadAcc::of_sample(s));
        self.stacks
            .entry((key, s.stack, s.flags & flags::NATIVE != 0))
            .or_default()
            .add(&TimeCount {
                ns: u64::from(s.weight_ns),
                count: 1,
            });
    }

    /// `ns` of an off-CPU interval.
    pub(crate) fn add_offcpu(&mut self, o: &OffCpu, ns: u64) {
        self.threads
            .entry((o.pid, o.tid))
            .or_default()
            .add(&ThreadAcc::of_offcpu(o, ns));
    }

    /// `ns` of a GIL wait whose holder ran `holder`, `count` 1 where it is counted.
    pub(crate) fn add_gil_wait(&mut self, g: &GilWait, holder: Holder, ns: u64, count: u64) {
        let key = (g.pid, g.tid);
        self.threads
            .entry(key)
            .or_default()
            .add(&ThreadAcc::of_gil_wait(g, ns, count));
        if !g.switch_wait {
            self.blame
                .entry((key, g.holder_tid, holder))
                .or_default()
                .add(&TimeCount { ns, count });
        }
    }

    /// `ns` of a GC pause, `count` 1 where it is counted.
    pub(crate) fn add_gc_pause(&mut self, g: &GcPause, ns: u64, count: u64) {
        self.threads
            .entry((g.pid, g.tid))
            .or_default()
            .add(&ThreadAcc::of_gc_pause(ns, count));
        self.gc
            .entry((g.pid, g.generation))
            .or_default()
            .add(&TimeCount { ns, count });
    }

    /// A probed call (counted where it ended).
    /// `ns` of a lock wait (of `count` waits) under `key`.
    pub(crate) fn add_lock_wait(&mut self, key: LockKey, ns: u64, count: u64) {
        self.lock_waits
            .entry(key)
            .or_default()
            .add(&TimeCount { ns, count });
    }

    pub(crate) fn add_call(&mut self, c: &FunctionCall) {
        self.calls
            .entry((c.probe, (c.pid, c.tid)))
            .or_default()
            .add(&TimeCount {
                ns: c.dur_ns,
                count: 1,
            });
    }

    /// Take out what `o` added (a bucket leaving a window); entries that reach zero go.
    pub fn sub(&mut self, o: &Sums) {
        sub_from(&mut self.threads, &o.threads);
        sub_from(&mut self.stacks, &o.stacks);
        sub_from(&mut self.functions, &o.functions);
        sub_from(&mut self.blame, &o.blame);
        sub_from(&mut self.gc, &o.gc);
        sub_from(&mut self.calls, &o.calls);
        sub_from(&mut self.lock_waits, &o.lock_waits);
    }

    /// Per-function sums of every stack in `stacks`, into `functions`.
    pub(crate) fn expand_stacks(&mut self, rec: &Recording, table: &mut FunctionTable) {
        for (&(key, stack, native), &tc) in &self.stacks {
            table.expand(rec, stack, native, tc, |f, acc| {
                self.functions.entry((key, f)).or_default().add(&acc);
            });
        }
    }
}

/// A stack's innermost function and the distinct functions on it.
type StackFns = (Option<FnId>, Box<[FnId]>);

/// Functions of the recording's frames and stacks, interned once: frames and stacks are only
/// ever appended, so each is looked at once. Ids follow the frame table's order.
#[derive(Debug, Default, Clone)]
pub struct FunctionTable {
    ids: HashMap<(String, String), FnId>,
    /// (qualified name, file) per id.
    pub names: Vec<(String, String)>,
    frame_fn: Vec<FnId>,
    /// Per stack: innermost function and the distinct functions on it (computed on first use).
    stacks: Vec<Option<StackFns>>,
}

impl FunctionTable {
    /// The table of `rec`'s frames and stacks.
    pub fn of(rec: &Recording) -> Self {
        let mut t = FunctionTable::default();
        t.sync(rec);
        t
    }

    /// Take in the frames and stacks appended to `rec` since the last call.
    pub fn sync(&mut self, rec: &Recording) {
        if rec.frames.len() < self.frame_fn.len() || rec.stacks.len() < self.stacks.len() {
            // A different recording: start over.
            *self = FunctionTable::default();
        }
        for f in &rec.frames[self.frame_fn.len()..] {
            let k = (f.function.clone(), f.file.clone());
            let next = self.names.len() as FnId;
            let id = *self.ids.entry(k).or_insert_with_key(|k| {
                self.names.push(k.clone());
                next
            });
            self.frame_fn.push(id);
        }
        self.stacks.resize(rec.stacks.len(), None);
    }

    /// A stack's innermost function and the distinct functions on it.
    pub fn stack(&mut self, rec: &Recording, stack: u32) -> (Option<FnId>, &[FnId]) {
        let Some(slot) = self.stacks.get_mut(stack as usize) else {
            return (None, &[]);
        };
        let frame_fn = &self.frame_fn;
        let entry = slot.get_or_insert_with(|| {
            let ids: Vec<FnId> = rec
                .stacks
                .get(stack as usize)
                .into_iter()
                .flatten()
                .filter_map(|&f| frame_fn.get(f as usize).copied())
                .collect();
            let mut distinct = ids.clone();
            distinct.sort_unstable();
            distinct.dedup();
            (ids.first().copied(), distinct.into_boxed_slice())
        });
        (entry.0, &entry.1)
    }

    /// What `tc` of on-CPU time on `stack` gives each of its functions: `each(function, sums)`.
    pub(crate) fn expand(
        &mut self,
        rec: &Recording,
        stack: u32,
        native: bool,
        tc: TimeCount,
        mut each: impl FnMut(FnId, FnAcc),
    ) {
        let (inner, distinct) = self.stack(rec, stack);
        if let Some(f) = inner {
            each(
                f,
                FnAcc {
                    self_ns: tc.ns,
                    self_native_ns: if native { tc.ns } else { 0 },
                    self_samples: tc.count,
                    ..FnAcc::default()
                },
            );
        }
        for &f in distinct {
            each(
                f,
                FnAcc {
                    total_ns: tc.ns,
                    total_samples: tc.count,
                    ..FnAcc::default()
                },
            );
        }
    }

    /// Innermost function of a stack.
    pub fn innermost(&self, rec: &Recording, stack: u32) -> Option<FnId> {
        rec.stacks
            .get(stack as usize)?
            .first()
            .and_then(|&f| self.frame_fn.get(f as usize).copied())
    }

    /// The innermost Python function of a stack whose (function, file) `keep` accepts.
    pub(crate) fn innermost_where(
        &self,
        rec: &Recording,
        stack: u32,
        keep: impl Fn(&str, &str) -> bool,
    ) -> Option<FnId> {
        rec.stacks
            .get(stack as usize)?
            .iter()
            .filter(|&&f| rec.frame_kind(f) == 0)
            .filter_map(|&f| self.frame_fn.get(f as usize).copied())
            .find(|&id| {
                let (function, file) = self.name(id);
                keep(function, file)
            })
    }

    /// What the holder of a GIL wait was running when it began.
    pub fn holder(&self, rec: &Recording, g: &GilWait) -> Holder {
        if g.holder_tid == 0 {
            Holder::Free
        } else if g.holder_tid == g.tid {
            Holder::Releasing
        } else {
            match self.innermost(rec, g.holder_stack) {
                Some(f) => Holder::Function(f),
                None => Holder::Unknown,
            }
        }
    }

    /// (qualified name, file) of a function; empty for an id not in the table.
    pub fn name(&self, f: FnId) -> (&str, &str) {
        self.names
            .get(f as usize)
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .unwrap_or(("", ""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Frame, Recording};

    fn frame(function: &str, line: i32) -> Frame {
        Frame {
            function: function.into(),
            file: "a.py".into(),
            line: Some(line),
        }
    }

    fn sample(tid: i32, stack: u32, weight_ns: u32, flags: u8) -> Sample {
        Sample {
            t_ns: 1,
            pid: 1,
            tid,
            stack,
            flags,
            weight_ns,
        }
    }

    fn wait(holder_tid: i32, dur_ns: u64, switch_wait: bool) -> GilWait {
        GilWait {
            pid: 1,
            tid: 2,
            start_ns: 0,
            dur_ns,
            holder_tid,
            holder_stack: 0,
            waiter_stack: 0,
            switch_wait,
        }
    }

    #[test]
    fn a_sample_splits_by_its_flags_and_its_stack_into_functions() {
        // f (two lines: one function) calls g calls f: recursion counted once in total.
        let rec = Recording {
            frames: vec![frame("f", 1), frame("g", 5), frame("f", 2)],
            stacks: vec![vec![0, 1, 2]],
            ..Recording::default()
        };
        let mut sums = Sums::default();
        sums.add_sample(&sample(7, 0, 10, flags::GIL | flags::NATIVE));
        sums.add_sample(&sample(7, 0, 30, flags::GC));
        let t = sums.threads[&(1, 7)];
        assert_eq!(
            (t.cpu_ns, t.native_ns, t.gil_held_ns, t.gc_cpu_ns, t.samples),
            (40, 10, 10, 30, 2)
        );
        let mut table = FunctionTable::of(&rec);
        sums.expand_stacks(&rec, &mut table);
        let f = sums.functions[&((1, 7), 0)];
        let g = sums.functions[&((1, 7), 1)];
        assert_eq!(table.name(0), ("f", "a.py"));
        assert_eq!((f.self_ns, f.self_native_ns, f.self_samples), (40, 10, 2));
        assert_eq!((f.total_ns, f.total_samples), (40, 2));
        assert_eq!((g.self_ns, g.total_ns, g.total_samples), (0, 40, 2));
    }

    #[test]
    fn switch_waits_are_neither_gil_waits_nor_blamed() {
        let rec = Recording::default();
        let table = FunctionTable::of(&rec);
        let mut sums = Sums::default();
        for g in [wait(3, 100, false), wait(3, 50, true)] {
            sums.add_gil_wait(&g, table.holder(&rec, &g), g.dur_ns, 1);
        }
        let t = sums.threads[&(1, 2)];
        assert_eq!((t.gil_wait_ns, t.gil_waits, t.switch_wait_ns), (100, 1, 50));
        assert_eq!(sums.blame.len(), 1);
        assert_eq!(
            sums.blame[&((1, 2), 3, Holder::Unknown)],
            TimeCount { ns: 100, count: 1 }
        );
        // The waiter itself releasing, and no holder.
        assert_eq!(table.holder(&rec, &wait(2, 1, false)), Holder::Releasing);
        assert_eq!(table.holder(&rec, &wait(0, 1, false)), Holder::Free);
    }

    #[test]
    fn taking_out_what_was_added_leaves_nothing() {
        let mut total = Sums::default();
        let mut part = Sums::default();
        let o = OffCpu {
            pid: 1,
            tid: 1,
            start_ns: 0,
            dur_ns: 9,
            stack: 0,
            preempted: true,
            stolen: false,
        };
        let gc = GcPause {
            pid: 1,
            tid: 1,
            start_ns: 0,
            dur_ns: 4,
            generation: 2,
            collected: 3,
        };
        for x in [&mut total, &mut part] {
            x.add_sample(&sample(1, 0, 5, 0));
            x.add_offcpu(&o, 9);
            x.add_gc_pause(&gc, 4, 1);
        }
        assert_eq!(total.threads[&(1, 1)].off_preempted_ns, 9);
        assert_eq!(total.gc[&(1, 2)], TimeCount { ns: 4, count: 1 });
        total.sub(&part);
        assert!(total.threads.is_empty() && total.stacks.is_empty() && total.gc.is_empty());
    }
}
