//! Turns resolved events into recording records: samples as they come, and the pairing of
//! switch-out/switch-in into off-CPU intervals, GIL-wait start/end into waits and GC edges into
//! pauses. Both sources feed it; it writes through a [`Sink`].

use std::collections::HashMap;

use super::sink::Sink;
use crate::bpf::abi;
use crate::record::format::StackCarry;
use crate::record::{GcPause, GilWait, OffCpu, RecordingWriter, Sample};

/// Per-thread off-CPU bookkeeping: the pending switch-out, or the stack read at start.
#[derive(Default)]
struct ThreadTimeline {
    /// (switch-out time, stack id, preempted)
    pending_out: Option<(u64, u32, bool)>,
    /// Stack at recording start, for a thread that had not run yet.
    initial_stack: Option<u32>,
    seen_event: bool,
    /// The thread's latest known stack (a sample, or a switch-out with its stack walked).
    last_stack: u32,
}

/// What kind of off-CPU interval [`Pipeline::write_offcpu`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Off {
    Blocked,
    Preempted,
    /// Taken by the hypervisor while on CPU (preempted too).
    Stolen,
}

impl Off {
    fn switched(preempted: bool) -> Off {
        if preempted {
            Off::Preempted
        } else {
            Off::Blocked
        }
    }
}

/// Where a thread's runtime was read ([`Pipeline::runtime_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnCpu {
    /// Switched in: on its CPU from here.
    Enters,
    /// Sampled on its CPU (the runtime as of the last tick: it lags by up to one).
    Runs,
    /// Switched out (the runtime brought up to date by the switch).
    Leaves,
}

/// What the hypervisor took from a thread while it was on its (virtual) CPU, so far: the
/// clock it spent there less the runtime the scheduler gave it.
#[derive(Default)]
struct Stolen {
    /// The last reading on the current stay on a CPU, begun by a switch-in: (absolute time,
    /// runtime). None between a switch-out and the next switch-in.
    since: Option<(u64, u64)>,
    /// Where the current stay's time not yet given to a stolen interval begins (absolute):
    /// its switch-in, then the end of the last one written. Stolen intervals lie inside the
    /// stays, so that one thread's off-CPU intervals never overlap.
    free_from: u64,
    /// Taken since the last interval written, ns (signed: a sample's runtime lags by up to a
    /// tick, which the next reading gives back).
    pending: i64,
}

/// Steal is written as an interval once this much has gathered (what less has gathered by a
/// switch-out waits for the next stays'): an interval per stay would be a record for most
/// switches on a VM with a little steal.
const STOLEN_MIN_NS: i64 = 1_000_000;

/// The most a sample's runtime lags (the scheduler brings it up to date at each tick): one
/// tick at the lowest `CONFIG_HZ` (100). On a stay, what has gathered since its switch-in is
/// the steal plus the current sample's lag: a sample writes only what exceeds this, the
/// switch-out (exact) the rest.
const RUNTIME_LAG_MAX_NS: i64 = 10_000_000;

/// A GIL wait that has begun and not yet ended.
struct PendingGilWait {
    start_ns: u64,
    holder_tid: i32,
    holder_stack: u32,
    waiter_stack: Option<u32>,
    switch_wait: bool,
}

/// A collection that has begun: when, in which thread, and the statistics then.
struct PendingGc {
    /// Absolute (CLOCK_MONOTONIC): a pause that spans a rotation is written whole in the
    /// segment where it ends.
    start_abs_ns: u64,
    tid: i32,
    stats: abi::GcStats,
}

/// How many records of each kind were written.
#[derive(Debug, Clone, Copy, Default)]
pub struct Written {
    pub samples: u64,
    pub offcpu: u64,
    pub gil_waits: u64,
    /// Wake-ups of a thread by another of its process (futex, not the GIL).
    pub wakes: u64,
    pub gc_pauses: u64,
    /// Collector calls (uprobe method) in which no generation's `collections` counter moved
    /// (3.13's `gc_collect_main` with nothing to collect): not pauses.
    pub gc_calls_without_collection: u64,
    /// Off-CPU intervals whose switch-in the kernel did not trace, ended at the first sign
    /// that the thread ran again (see [`Pipeline::end_missed_switch_in`]).
    pub switch_ins_missed: u64,
    /// Switch-ins of a thread already seen with no switch-out before them.
    pub switch_ins_unpaired: u64,
    /// Intervals of what the hypervisor took from a thread on its CPU ([`Pipeline::runtime_at`]).
    pub stolen: u64,
}

pub struct Pipeline<W: Sink = RecordingWriter> {
    pub writer: W,
    /// `CLOCK_MONOTONIC` at the start of the recording (of the segment, when rotating): event
    /// times are written relative to it.
    pub start_ns: u64,
    /// Before the window (the warm-up, while probes are being placed): nothing that happens
    /// is written, and every time written is the window's start (0). See
    /// [`Self::begin_window`].
    pub pre_window: bool,
    /// The window's start (absolute): nothing before it is written. Unlike `start_ns` it
    /// stays when a rotating recorder starts a new segment (an interval open across the
    /// rotation is the new segment's, from its start).
    window_ns: u64,
    /// CPU time one sample stands for (the sampling period).
    pub weight_ns: u32,
    /// Measured cost of one watchpoint hit, subtracted from each GC pause (probe effect).
    pub gc_trap_ns: u64,
    /// Processes whose GC pauses come from uprobes on the collector (no trap inside the
    /// interval to subtract; a call that collected nothing is not a pause).
    pub gc_uprobe_pids: std::collections::HashSet<i32>,
    pub written: Written,
    timelines: HashMap<(i32, i32), ThreadTimeline>,
    gil_waits: HashMap<(i32, i32), PendingGilWait>,
    gc: HashMap<i32, PendingGc>,
    stolen: HashMap<(i32, i32), Stolen>,
    /// Switch-ins and switch-outs come with the thread's runtime ([`Self::runtime_at`]).
    pub measure_steal: bool,
    /// Switch tracing is off (`record --measure-cost`'s arms): see [`Self::pause_switches`].
    switches_paused: bool,
}

impl<W: Sink> Pipeline<W> {
    pub fn new(writer: W, start_ns: u64, rate_hz: u32) -> Self {
        Pipeline {
            writer,
            start_ns,
            pre_window: false,
            window_ns: start_ns,
            weight_ns: (1_000_000_000u64 / rate_hz.max(1) as u64) as u32,
            gc_trap_ns: 0,
            gc_uprobe_pids: std::collections::HashSet::new(),
            written: Written::default(),
            timelines: HashMap::new(),
            gil_waits: HashMap::new(),
            gc: HashMap::new(),
            stolen: HashMap::new(),
            measure_steal: false,
            switches_paused: false,
        }
    }

    /// `t` (absolute) as a time in the window: 0 before it, and for anything written before
    /// the window began.
    pub fn rel(&self, t: u64) -> u64 {
        if self.pre_window {
            0
        } else {
            t.saturating_sub(self.start_ns)
        }
    }

    /// Whether something at absolute time `t` lies in the window (and is written).
    pub fn in_window(&self, t: u64) -> bool {
        !self.pre_window && t >= self.window_ns
    }

    /// Start the window at `start_ns` (absolute): from now on events at or after it are
    /// written, relative to it; intervals open since before it count from it.
    pub(crate) fn begin_window(&mut self, start_ns: u64) {
        self.start_ns = start_ns;
        self.window_ns = start_ns;
        self.pre_window = false;
        // What was taken before the window is not the window's.
        self.stolen.clear();
    }

    /// Switch tracing goes off at `edge_ns` (absolute; `record --measure-cost`'s arms). What it
    /// saw ends there, as at the recording's end ([`Self::close`]): an interval still open (a
    /// thread off CPU, since before the recording too, or waiting for the GIL) is written up to
    /// the edge, since neither its end nor what the thread did until switches are
    /// traced again will be known; and a stay on a CPU is forgotten, since without its
    /// switch-out a thread's time asleep would read as taken by the hypervisor. Until
    /// [`Self::resume_switches`], switch events (late ones from before the edge) are dropped
    /// and samples measure no steal.
    pub(crate) fn pause_switches(&mut self, edge_ns: u64) -> anyhow::Result<()> {
        self.switches_paused = true;
        self.close(edge_ns)?;
        self.stolen.clear();
        Ok(())
    }

    /// Whether switch tracing is off ([`Self::pause_switches`]).
    pub(crate) fn switches_paused(&self) -> bool {
        self.switches_paused
    }

    /// Switch tracing is on again: intervals begin at the switch-outs that follow, stays at the
    /// switch-ins.
    pub(crate) fn resume_switches(&mut self) {
        self.switches_paused = false;
        self.stolen.clear();
    }

    /// A thread's scheduler runtime (`runtime_ns`, 0: unknown) read at `t_ns` while it was on
    /// its CPU, or as it entered or left it. The runtime leaves out what the hypervisor ran
    /// instead while the vCPU was the thread's (and, on kernels that account interrupts apart,
    /// interrupts): between two readings on one stay on a CPU, the clock less the runtime is
    /// what was taken. No switch shows it and no CPU time counts it, yet the thread waited:
    /// it is written as an off-CPU interval marked stolen (and preempted: runnable, not
    /// running) inside the stay where it was taken, so that on-CPU, off-CPU and stolen make
    /// up the thread's time, and a thread's off-CPU intervals never overlap.
    pub(crate) fn runtime_at(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        runtime_ns: u64,
        at: OnCpu,
    ) -> anyhow::Result<()> {
        if runtime_ns == 0 || !self.measure_steal || self.switches_paused {
            return Ok(());
        }
        let in_window = self.in_window(t_ns);
        let s = self.stolen.entry((pid, tid)).or_default();
        if let (Some((t0, r0)), true) = (s.since, at != OnCpu::Enters) {
            let clock = t_ns.saturating_sub(t0) as i64;
            let ran = runtime_ns.saturating_sub(r0) as i64;
            // A new thread with the id of a gone one reads a lower runtime: nothing counted.
            if runtime_ns >= r0 {
                // A runtime ahead of the clock (they tick apart) is given back later, within
                // a bound.
                s.pending = (s.pending + clock - ran).max(-STOLEN_MIN_NS);
            }
        }
        // A stay is measured from its switch-in only: a thread's samples alone (running since
        // before the recording, or not yet known to the kernel side, which then sends no
        // switches for it) would count its time off CPU in between as taken.
        let on_stay = s.since.is_some() || at == OnCpu::Enters;
        if at == OnCpu::Enters {
            s.free_from = t_ns;
        }
        s.since = match at {
            OnCpu::Leaves => None,
            OnCpu::Enters => Some((t_ns, runtime_ns)),
            OnCpu::Runs => s.since.map(|_| (t_ns, runtime_ns)),
        };
        // What is certainly stolen: all of it when the runtime is exact (a switch), less the
        // sample's lag otherwise.
        let certain = match at {
            OnCpu::Leaves => s.pending,
            OnCpu::Runs => s.pending - RUNTIME_LAG_MAX_NS,
            OnCpu::Enters => 0,
        };
        // Placed from the start of what this stay has not given yet (where in the stay the
        // hypervisor took it is not known): more than the stay holds waits for the next ones.
        let from = s.free_from.max(self.window_ns);
        let ns = certain.min(t_ns.saturating_sub(from) as i64);
        if certain < STOLEN_MIN_NS || ns <= 0 || !on_stay || !in_window {
            return Ok(());
        }
        s.pending -= ns;
        s.free_from = from + ns as u64;
        let start = self.rel(from);
        let stack = self.last_stack(pid, tid);
        self.write_offcpu(pid, tid, (start, start + ns as u64), stack, Off::Stolen)
    }

    /// A timer sample of a thread, standing for `weight_ns` of its CPU time (the period, less
    /// what the hypervisor stole: [`super::runtime_weight`]).
    pub fn sample(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        stack: u32,
        fl: u8,
        weight_ns: u64,
    ) -> anyhow::Result<()> {
        self.end_missed_switch_in(pid, tid, t_ns)?;
        let tl = self.timelines.entry((pid, tid)).or_default();
        tl.seen_event = true;
        tl.initial_stack = None;
        tl.last_stack = stack;
        self.sample_weighted(pid, tid, t_ns, stack, fl, weight_ns)
    }

    /// The thread's latest known stack: what a switch-out recorded without a stack walk (a
    /// yield in a busy-wait loop) is attributed to. 0 (empty) when none is known yet.
    pub(crate) fn last_stack(&self, pid: i32, tid: i32) -> u32 {
        self.timelines.get(&(pid, tid)).map_or(0, |t| {
            if t.last_stack != 0 {
                t.last_stack
            } else {
                t.initial_stack.unwrap_or(0)
            }
        })
    }

    /// A sample standing for `weight_ns` of CPU time (the memory backend's measured CPU time).
    pub(crate) fn sample_weighted(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        stack: u32,
        fl: u8,
        weight_ns: u64,
    ) -> anyhow::Result<()> {
        if !self.in_window(t_ns) {
            return Ok(());
        }
        let t = self.rel(t_ns);
        self.written.samples += 1;
        self.writer.sample(&Sample {
            t_ns: t,
            pid,
            tid,
            stack,
            flags: fl,
            weight_ns: weight_ns.min(u32::MAX as u64) as u32,
        })
    }

    /// An off-CPU interval known as a whole (the memory backend's share of a tick off CPU).
    pub(crate) fn offcpu_interval(
        &mut self,
        pid: i32,
        tid: i32,
        start_ns: u64,
        dur_ns: u64,
        stack: u32,
    ) -> anyhow::Result<()> {
        if !self.in_window(start_ns) {
            return Ok(());
        }
        self.written.offcpu += 1;
        self.writer.offcpu(&OffCpu {
            pid,
            tid,
            start_ns: self.rel(start_ns),
            dur_ns,
            stack,
            preempted: false,
            stolen: false,
        })
    }

    pub(crate) fn switch_out(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        stack: u32,
        preempted: bool,
    ) -> anyhow::Result<()> {
        if self.switches_paused {
            return Ok(());
        }
        self.end_missed_switch_in(pid, tid, t_ns)?;
        let t = self.rel(t_ns);
        if let Some(w) = self.gil_waits.get_mut(&(pid, tid)) {
            w.waiter_stack.get_or_insert(stack);
        }
        let tl = self.timelines.entry((pid, tid)).or_default();
        tl.seen_event = true;
        tl.initial_stack = None;
        if stack != 0 {
            tl.last_stack = stack;
        }
        tl.pending_out = Some((t, stack, preempted));
        Ok(())
    }

    /// The thread is on CPU at `t_ns` (sampled, or switching out): an interval still open
    /// means the kernel traced no switch-in for it. On this machine's kernel (6.18, measured
    /// with ftrace's own `sched_switch` events beside the BPF program's) about one switch-in
    /// in a hundred of a thread competing for its CPU has no `sched_switch` event: the thread
    /// is switched out twice in a row, and sampled on CPU in between. Left open, the interval
    /// would be overwritten by the next switch-out and lost (an event loop's idle wait gone,
    /// two stalls merged into one). It ends here instead, the first sign that the thread ran
    /// again: at most the thread's CPU time since the untraced switch-in too late (under one
    /// sampling period when a sample is the sign). Counted in `offcpu_switch_ins_missed`.
    fn end_missed_switch_in(&mut self, pid: i32, tid: i32, t_ns: u64) -> anyhow::Result<()> {
        let Some(tl) = self.timelines.get_mut(&(pid, tid)) else {
            return Ok(());
        };
        let Some((start, stack, preempted)) = tl.pending_out.take() else {
            return Ok(());
        };
        let t = self.rel(t_ns);
        self.written.switch_ins_missed += 1;
        self.write_offcpu(pid, tid, (start, t), stack, Off::switched(preempted))
    }

    /// Write the off-CPU interval `[start, end)` (relative times), counted as an interval or
    /// as steal.
    fn write_offcpu(
        &mut self,
        pid: i32,
        tid: i32,
        (start, end): (u64, u64),
        stack: u32,
        off: Off,
    ) -> anyhow::Result<()> {
        if self.pre_window {
            return Ok(());
        }
        if off == Off::Stolen {
            self.written.stolen += 1;
        } else {
            self.written.offcpu += 1;
        }
        self.writer.offcpu(&OffCpu {
            pid,
            tid,
            start_ns: start,
            dur_ns: end.saturating_sub(start),
            stack,
            preempted: off != Off::Blocked,
            stolen: off == Off::Stolen,
        })
    }

    pub(crate) fn switch_in(&mut self, pid: i32, tid: i32, t_ns: u64) -> anyhow::Result<()> {
        if self.switches_paused {
            return Ok(());
        }
        let t = self.rel(t_ns);
        let tl = self.timelines.entry((pid, tid)).or_default();
        let first = !tl.seen_event;
        tl.seen_event = true;
        let iv = match (tl.pending_out.take(), tl.initial_stack.take()) {
            (Some((start, stack, preempted)), _) => Some((start, stack, preempted)),
            // Blocked since before the recording started: off CPU from the start.
            (None, Some(stack)) if first => Some((0, stack, false)),
            _ => {
                if !first {
                    self.written.switch_ins_unpaired += 1;
                }
                None
            }
        };
        match iv {
            Some((start, stack, preempted)) => {
                self.write_offcpu(pid, tid, (start, t), stack, Off::switched(preempted))
            }
            None => Ok(()),
        }
    }

    /// Remember a thread's stack at start: if its first event is a switch-in, it was off CPU
    /// (there) from the start; if it never has an event, for the whole recording.
    pub(crate) fn initial_stack(&mut self, pid: i32, tid: i32, stack: u32) {
        let tl = self.timelines.entry((pid, tid)).or_default();
        if !tl.seen_event {
            tl.initial_stack = Some(stack);
        }
    }

    pub(crate) fn gil_wait_start(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        holder_tid: i32,
        holder_stack: u32,
        switch_wait: bool,
    ) {
        if self.switches_paused {
            return;
        }
        let start_ns = self.rel(t_ns);
        self.gil_waits.insert(
            (pid, tid),
            PendingGilWait {
                start_ns,
                holder_tid,
                holder_stack,
                waiter_stack: None,
                switch_wait,
            },
        );
    }

    /// Thread `tid` woken by `waker_tid` of the same process, which was running `waker_stack`.
    pub fn wake(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        waker_tid: i32,
        waker_stack: u32,
    ) -> anyhow::Result<()> {
        if self.pre_window {
            return Ok(());
        }
        self.written.wakes += 1;
        let t_ns = self.rel(t_ns);
        self.writer.wake(&crate::record::Wake {
            t_ns,
            pid,
            tid,
            waker_tid,
            waker_stack,
        })
    }

    /// Returns false when no wait was open (the recorder attached during it).
    pub(crate) fn gil_wait_end(&mut self, pid: i32, tid: i32, t_ns: u64) -> anyhow::Result<bool> {
        let end = self.rel(t_ns);
        let Some(w) = self.gil_waits.remove(&(pid, tid)) else {
            return Ok(false);
        };
        self.write_gil_wait(pid, tid, &w, end)?;
        Ok(true)
    }

    fn write_gil_wait(
        &mut self,
        pid: i32,
        tid: i32,
        w: &PendingGilWait,
        end: u64,
    ) -> anyhow::Result<()> {
        if self.pre_window {
            return Ok(());
        }
        self.written.gil_waits += 1;
        self.writer.gil_wait(&GilWait {
            pid,
            tid,
            start_ns: w.start_ns,
            dur_ns: end.saturating_sub(w.start_ns),
            holder_tid: w.holder_tid,
            holder_stack: w.holder_stack,
            waiter_stack: w.waiter_stack.unwrap_or(0),
            switch_wait: w.switch_wait,
        })
    }

    /// A write to a target's `gcstate->collecting`: 1 starts a pause, 0 ends it.
    pub(crate) fn gc_edge(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        value: i64,
        stats: abi::GcStats,
    ) -> anyhow::Result<()> {
        if value != 0 {
            self.gc.entry(pid).or_insert(PendingGc {
                start_abs_ns: t_ns,
                tid,
                stats,
            });
            return Ok(());
        }
        let Some(mut p) = self.gc.remove(&pid) else {
            return Ok(());
        };
        if self.pre_window {
            return Ok(());
        }
        // A pause under way when the window began counts from its start.
        p.start_abs_ns = p.start_abs_ns.max(self.window_ns);
        let uprobe = self.gc_uprobe_pids.contains(&pid);
        // The generation whose `collections` counter moved; the oldest one if several did.
        let moved = (0..3)
            .rev()
            .find(|&g| stats.collections[g] > p.stats.collections[g]);
        // The statistics are known (some counter is non-zero) but none moved: a collector call
        // that returned without collecting (uprobe method; a watched `collecting` flag is only
        // set around a collection).
        let stats_known = p.stats.collections.iter().any(|&c| c > 0);
        if uprobe && moved.is_none() && stats_known {
            self.written.gc_calls_without_collection += 1;
            return Ok(());
        }
        let generation = moved
            .map(|g| g as i8)
            .or_else(|| {
                // Unknown statistics (3.15): the collector's argument, where it names one.
                (0..3)
                    .contains(&p.stats.generation_arg)
                    .then_some(p.stats.generation_arg as i8)
            })
            .unwrap_or(-1);
        let collected = match moved {
            Some(g) => stats.collected[g]
                .checked_sub(p.stats.collected[g])
                .map(|d| d as i64)
                .unwrap_or(-1),
            None => -1,
        };
        // The watchpoint's own trap (the end of the first hit, the start of the second) is
        // inside the interval but is not the collector's: take it out. A uprobe's cost
        // (~0.5 us) is left in.
        let trap = if uprobe { 0 } else { self.gc_trap_ns };
        self.written.gc_pauses += 1;
        self.writer.gc_pause(&GcPause {
            pid,
            tid: p.tid,
            start_ns: self.rel(p.start_abs_ns),
            dur_ns: t_ns.saturating_sub(p.start_abs_ns).saturating_sub(trap),
            generation,
            collected,
        })
    }

    /// Write every thread's off-CPU interval still open (switched out, or blocked since before
    /// the recording) up to `end`, in (pid, tid) order. `close`: they end here; otherwise
    /// (a segment rotation) they stay open and the next segment goes on with them.
    fn write_open_offcpu(&mut self, end: u64, close: bool) -> anyhow::Result<()> {
        let mut open = Vec::new();
        for (&(pid, tid), tl) in &mut self.timelines {
            let (pending, initial) = if close {
                (tl.pending_out.take(), tl.initial_stack.take())
            } else {
                (tl.pending_out, tl.initial_stack)
            };
            if let Some((start, stack, preempted)) = pending {
                open.push((pid, tid, start, stack, preempted));
            } else if let (Some(stack), false) = (initial, tl.seen_event) {
                open.push((pid, tid, 0, stack, false));
            }
        }
        open.sort_by_key(|x| (x.0, x.1));
        for (pid, tid, start, stack, preempted) in open {
            self.write_offcpu(pid, tid, (start, end), stack, Off::switched(preempted))?;
        }
        Ok(())
    }

    /// Close intervals still open at the end.
    pub fn close(&mut self, end_ns: u64) -> anyhow::Result<()> {
        let end = self.rel(end_ns);
        let mut waits: Vec<_> = self.gil_waits.drain().collect();
        waits.sort_by_key(|(k, _)| *k);
        for ((pid, tid), w) in waits {
            self.write_gil_wait(pid, tid, &w, end)?;
        }
        self.write_open_offcpu(end, true)?;
        Ok(())
    }

    /// Before a segment ends at `end_ns`: forget threads and processes that exited (a dead
    /// thread's last switch-out is its exit, not a wait), then write the part so far of every
    /// interval still open (off CPU, GIL waits); they stay open.
    pub(crate) fn split_open(
        &mut self,
        end_ns: u64,
        thread_alive: &dyn Fn(i32, i32) -> bool,
        process_alive: &dyn Fn(i32) -> bool,
    ) -> anyhow::Result<()> {
        let end = self.rel(end_ns);
        self.timelines
            .retain(|&(pid, tid), _| thread_alive(pid, tid));
        self.stolen.retain(|&(pid, tid), _| thread_alive(pid, tid));
        self.gil_waits
            .retain(|&(pid, tid), _| thread_alive(pid, tid));
        self.gc.retain(|&pid, _| process_alive(pid));
        self.write_open_offcpu(end, false)?;
        let mut waits: Vec<(i32, i32)> = self.gil_waits.keys().copied().collect();
        waits.sort_unstable();
        for (pid, tid) in waits {
            if let Some(w) = self.gil_waits.remove(&(pid, tid)) {
                let res = self.write_gil_wait(pid, tid, &w, end);
                self.gil_waits.insert((pid, tid), w);
                res?;
            }
        }
        Ok(())
    }

    /// Write the part so far of every open off-CPU interval and GIL wait, and let each go on
    /// from `end_ns`. For an aggregating writer (the agent's default, `record::profile`),
    /// which adds events up per aggregation interval as they are written: without the split,
    /// a wait open across intervals counts whole in the one where it ends (a thread blocked
    /// through a 6 s window read 5.2 s off CPU in it).
    pub(crate) fn split_open_at(&mut self, end_ns: u64) -> anyhow::Result<()> {
        let end = self.rel(end_ns);
        self.write_open_offcpu(end, false)?;
        for tl in self.timelines.values_mut() {
            if let Some(p) = tl.pending_out.as_mut() {
                p.0 = p.0.max(end);
            } else if let (Some(stack), false) = (tl.initial_stack, tl.seen_event) {
                tl.pending_out = Some((end, stack, false));
            }
        }
        let mut waits: Vec<(i32, i32)> = self.gil_waits.keys().copied().collect();
        waits.sort_unstable();
        for (pid, tid) in waits {
            if let Some(mut w) = self.gil_waits.remove(&(pid, tid)) {
                let res = self.write_gil_wait(pid, tid, &w, end);
                w.start_ns = w.start_ns.max(end);
                self.gil_waits.insert((pid, tid), w);
                res?;
            }
        }
        Ok(())
    }

    /// After a segment started at `start_ns`: intervals still open go on from its start, at
    /// their stacks as `carry` maps them into the new segment.
    pub(crate) fn continue_open(
        &mut self,
        start_ns: u64,
        carry: &mut dyn FnMut(&mut W, u32) -> anyhow::Result<u32>,
    ) -> anyhow::Result<()> {
        self.start_ns = start_ns;
        for tl in self.timelines.values_mut() {
            if let Some((_, stack, preempted)) = tl.pending_out {
                tl.pending_out = Some((0, carry(&mut self.writer, stack)?, preempted));
            }
            if let Some(stack) = tl.initial_stack {
                tl.initial_stack = Some(carry(&mut self.writer, stack)?);
            }
            tl.last_stack = carry(&mut self.writer, tl.last_stack)?;
        }
        for w in self.gil_waits.values_mut() {
            w.start_ns = 0;
            w.holder_stack = carry(&mut self.writer, w.holder_stack)?;
            if let Some(s) = w.waiter_stack {
                w.waiter_stack = Some(carry(&mut self.writer, s)?);
            }
        }
        Ok(())
    }
}

impl Pipeline<RecordingWriter> {
    /// [`Self::continue_open`] with a rotation's stack carry.
    pub(crate) fn carry_open(&mut self, start_ns: u64, carry: &StackCarry) -> anyhow::Result<()> {
        self.continue_open(start_ns, &mut |w, s| carry.carry(w, s))
    }
}

#[cfg(test)]
mod tests {
    use super::super::sink::Event;
    use super::*;

    const MS: u64 = 1_000_000;

    fn pipe() -> Pipeline<Vec<Event>> {
        Pipeline::new(Vec::new(), 1000 * MS, 100)
    }

    fn offcpu(events: &[Event]) -> Vec<(i32, u64, u64, u32, bool)> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::OffCpu(o) => Some((o.tid, o.start_ns, o.dur_ns, o.stack, o.preempted)),
                _ => None,
            })
            .collect()
    }

    /// (tid, start, dur, stack) of the stolen intervals.
    fn stolen(events: &[Event]) -> Vec<(i32, u64, u64, u32)> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::OffCpu(o) if o.stolen => {
                    assert!(o.preempted, "stolen is preempted too");
                    Some((o.tid, o.start_ns, o.dur_ns, o.stack))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn steal_is_a_stays_clock_less_its_runtime() {
        let mut p = pipe();
        p.measure_steal = true;
        let t0 = p.start_ns;
        let r0 = 5_000 * MS;
        // A stay of 40 ms that ran 30: 10 ms taken, written at the switch-out, from the stay's
        // start.
        p.switch_in(1, 10, t0 + 10 * MS).unwrap();
        p.runtime_at(1, 10, t0 + 10 * MS, r0, OnCpu::Enters)
            .unwrap();
        p.sample(1, 10, t0 + 20 * MS, 7, 0, 10 * MS).unwrap();
        // The sample's runtime lags (a tick): nothing certain yet.
        p.runtime_at(1, 10, t0 + 20 * MS, r0 + 4 * MS, OnCpu::Runs)
            .unwrap();
        assert!(stolen(&p.writer).is_empty());
        p.runtime_at(1, 10, t0 + 50 * MS, r0 + 30 * MS, OnCpu::Leaves)
            .unwrap();
        p.switch_out(1, 10, t0 + 50 * MS, 8, false).unwrap();
        assert_eq!(stolen(&p.writer), [(10, 10 * MS, 10 * MS, 7)]);
        // Off CPU in between is not taken: the next stay starts at its switch-in, and samples
        // of a thread with no switch-in seen (12) count nothing.
        p.switch_in(1, 10, t0 + 80 * MS).unwrap();
        p.runtime_at(1, 10, t0 + 80 * MS, r0 + 30 * MS, OnCpu::Enters)
            .unwrap();
        p.runtime_at(1, 12, t0 + 80 * MS, r0, OnCpu::Runs).unwrap();
        p.runtime_at(1, 12, t0 + 180 * MS, r0 + MS, OnCpu::Runs)
            .unwrap();
        // A long stay with a third taken: samples write what exceeds the most a runtime lags,
        // the switch-out the rest; the sum is exact.
        for i in 1..=30u64 {
            p.runtime_at(
                1,
                10,
                t0 + (80 + 10 * i) * MS,
                r0 + (30 + 7 * i) * MS,
                OnCpu::Runs,
            )
            .unwrap();
        }
        p.runtime_at(1, 10, t0 + 390 * MS, r0 + 240 * MS, OnCpu::Leaves)
            .unwrap();
        let s = stolen(&p.writer);
        assert!(s.len() > 2, "{s:?}");
        assert!(s.iter().all(|x| x.0 == 10));
        let after: u64 = s[1..].iter().map(|x| x.2).sum();
        assert_eq!(after, 310 * MS - 210 * MS);
        assert_eq!(p.written.stolen, s.len() as u64);
        // Stays with a little taken each: written once a millisecond has gathered, inside the
        // stay that has it (never over the thread's off-CPU intervals); less waits.
        let before = stolen(&p.writer).len();
        let mut r = r0 + 240 * MS;
        for i in 0..5u64 {
            let t = t0 + (400 + 10 * i) * MS;
            p.runtime_at(1, 10, t, r, OnCpu::Enters).unwrap();
            r += 5 * MS - 400_000;
            p.runtime_at(1, 10, t + 5 * MS, r, OnCpu::Leaves).unwrap();
        }
        let s = stolen(&p.writer);
        assert_eq!(s.len(), before + 1, "{s:?}");
        assert_eq!(s[before].2, 1_200_000);
        assert_eq!(s[before].1, 420 * MS);
        // More than a stay holds: what it holds, the rest later.
        p.runtime_at(1, 10, t0 + 600 * MS, r, OnCpu::Enters)
            .unwrap();
        p.runtime_at(1, 10, t0 + 602 * MS, r + MS / 2, OnCpu::Leaves)
            .unwrap();
        let s = stolen(&p.writer);
        assert_eq!(
            s[before + 1].1..s[before + 1].1 + s[before + 1].2,
            600 * MS..602 * MS
        );
        // Not measured without switch records.
        let mut q = pipe();
        q.switch_in(1, 10, t0 + 10 * MS).unwrap();
        q.runtime_at(1, 10, t0 + 10 * MS, r0, OnCpu::Enters)
            .unwrap();
        q.runtime_at(1, 10, t0 + 50 * MS, r0 + 10 * MS, OnCpu::Leaves)
            .unwrap();
        assert!(stolen(&q.writer).is_empty());
    }

    /// `record --measure-cost`'s arms with switch tracing off: a thread that goes to sleep and
    /// wakes unseen, sampled meanwhile, reads its sleep as clock less runtime. None of it is
    /// steal, and nothing is written inside the hole but what the edge cut.
    #[test]
    fn no_interval_or_steal_inside_a_hole_in_switch_tracing() {
        let mut p = pipe();
        p.measure_steal = true;
        let t0 = p.start_ns;
        let r0 = 5_000 * MS;
        // Thread 10 on its CPU from 10 ms; thread 11 asleep from 20 ms; 11 waits for the GIL.
        p.switch_in(1, 10, t0 + 10 * MS).unwrap();
        p.runtime_at(1, 10, t0 + 10 * MS, r0, OnCpu::Enters)
            .unwrap();
        p.switch_out(1, 11, t0 + 20 * MS, 9, false).unwrap();
        p.gil_wait_start(1, 12, t0 + 25 * MS, 10, 7, true);
        // Thread 13 asleep since before the recording, with no event yet.
        p.initial_stack(1, 13, 4);
        // Off at 30 ms: the open intervals and the GIL wait end there.
        p.pause_switches(t0 + 30 * MS).unwrap();
        assert!(p.switches_paused());
        assert_eq!(
            offcpu(&p.writer),
            [(11, 20 * MS, 10 * MS, 9, false), (13, 0, 30 * MS, 4, false)]
        );
        let gil: Vec<(i32, u64, u64)> = p
            .writer
            .iter()
            .filter_map(|e| match e {
                Event::GilWait(g) => Some((g.tid, g.start_ns, g.dur_ns)),
                _ => None,
            })
            .collect();
        assert_eq!(gil, [(12, 25 * MS, 5 * MS)]);
        // In the hole: 10 sleeps 100 ms of every 110 unseen and is sampled when it runs; a late
        // switch event from before the edge is dropped.
        p.switch_out(1, 10, t0 + 29 * MS, 8, false).unwrap();
        for i in 1..=5u64 {
            let t = t0 + (30 + 110 * i) * MS;
            p.sample(1, 10, t, 7, 0, 10 * MS).unwrap();
            p.runtime_at(1, 10, t, r0 + 10 * i * MS, OnCpu::Runs)
                .unwrap();
        }
        assert!(!p.gil_wait_end(1, 12, t0 + 600 * MS).unwrap());
        p.resume_switches();
        // On again: the first switch-in is unpaired, the next switch-out begins an interval.
        p.switch_in(1, 11, t0 + 700 * MS).unwrap();
        p.switch_out(1, 11, t0 + 710 * MS, 9, false).unwrap();
        p.switch_in(1, 11, t0 + 720 * MS).unwrap();
        // 13's first switch-in: its wait was written up to the edge already.
        p.switch_in(1, 13, t0 + 730 * MS).unwrap();
        assert!(stolen(&p.writer).is_empty(), "{:?}", stolen(&p.writer));
        assert_eq!(
            offcpu(&p.writer),
            [
                (11, 20 * MS, 10 * MS, 9, false),
                (13, 0, 30 * MS, 4, false),
                (11, 710 * MS, 10 * MS, 9, false)
            ]
        );
        assert_eq!(p.written.samples, 5);
    }

    #[test]
    fn switches_pair_into_intervals() {
        let mut p = pipe();
        let t0 = p.start_ns;
        p.sample(1, 10, t0 + 5 * MS, 7, 0, 10 * MS).unwrap();
        p.switch_out(1, 10, t0 + 10 * MS, 8, false).unwrap();
        p.switch_in(1, 10, t0 + 25 * MS).unwrap();
        // Yielded (no stack walked): the last known stack stands for it.
        let last = p.last_stack(1, 10);
        assert_eq!(last, 8);
        p.switch_out(1, 10, t0 + 30 * MS, last, true).unwrap();
        p.switch_in(1, 10, t0 + 31 * MS).unwrap();
        // A switch-in with no switch-out before it (attached while running): nothing.
        p.switch_in(1, 11, t0 + 40 * MS).unwrap();
        assert_eq!(
            offcpu(&p.writer),
            [(10, 10 * MS, 15 * MS, 8, false), (10, 30 * MS, MS, 8, true)]
        );
        assert_eq!(p.written.samples, 1);
        assert_eq!(p.written.offcpu, 2);
        match p.writer[0] {
            Event::Sample(s) => assert_eq!((s.t_ns, s.weight_ns), (5 * MS, 10 * MS as u32)),
            ref e => panic!("{e:?}"),
        }
    }

    /// The kernel sometimes traces no switch-in (see `end_missed_switch_in`): the interval
    /// ends at the thread's next sample or switch-out instead of being overwritten.
    #[test]
    fn a_missed_switch_in_ends_at_the_next_sign_of_running() {
        let mut p = pipe();
        let t0 = p.start_ns;
        // Blocked at 10 ms, woken without a traced switch-in, sampled at 300 ms.
        p.switch_out(1, 10, t0 + 10 * MS, 8, false).unwrap();
        p.sample(1, 10, t0 + 300 * MS, 7, 0, 10 * MS).unwrap();
        // Preempted at 310 ms, back on CPU untraced, switched out again at 312 ms, and this
        // time its switch-in is traced.
        p.switch_out(1, 10, t0 + 310 * MS, 7, true).unwrap();
        p.switch_out(1, 10, t0 + 312 * MS, 9, false).unwrap();
        p.switch_in(1, 10, t0 + 320 * MS).unwrap();
        assert_eq!(
            offcpu(&p.writer),
            [
                (10, 10 * MS, 290 * MS, 8, false),
                (10, 310 * MS, 2 * MS, 7, true),
                (10, 312 * MS, 8 * MS, 9, false)
            ]
        );
        assert_eq!(p.written.switch_ins_missed, 2);
        assert_eq!(p.written.switch_ins_unpaired, 0);
    }

    #[test]
    fn blocked_since_start_and_open_at_close() {
        let mut p = pipe();
        let t0 = p.start_ns;
        // Thread 20 was blocked at start and wakes at 12 ms; thread 21 never runs; thread 22
        // runs first (its start stack is forgotten); thread 23 blocks and never wakes.
        for tid in [20, 21, 22] {
            p.initial_stack(1, tid, 100 + tid as u32);
        }
        p.switch_in(1, 20, t0 + 12 * MS).unwrap();
        p.sample(1, 22, t0 + 13 * MS, 5, 0, 10 * MS).unwrap();
        p.switch_out(1, 23, t0 + 14 * MS, 6, false).unwrap();
        p.close(t0 + 50 * MS).unwrap();
        assert_eq!(
            offcpu(&p.writer),
            [
                (20, 0, 12 * MS, 120, false),
                (21, 0, 50 * MS, 121, false),
                (23, 14 * MS, 36 * MS, 6, false)
            ]
        );
    }

    #[test]
    fn gil_waits_take_the_first_blocking_stack() {
        let mut p = pipe();
        let t0 = p.start_ns;
        p.gil_wait_start(1, 10, t0 + MS, 11, 40, true);
        p.switch_out(1, 10, t0 + 2 * MS, 41, false).unwrap();
        p.switch_out(1, 10, t0 + 3 * MS, 42, false).unwrap();
        assert!(p.gil_wait_end(1, 10, t0 + 6 * MS).unwrap());
        assert!(!p.gil_wait_end(1, 10, t0 + 7 * MS).unwrap(), "none open");
        p.gil_wait_start(1, 12, t0 + 8 * MS, 10, 43, false);
        p.close(t0 + 9 * MS).unwrap();
        let waits: Vec<GilWait> = p
            .writer
            .iter()
            .filter_map(|e| match e {
                Event::GilWait(w) => Some(*w),
                _ => None,
            })
            .collect();
        assert_eq!(waits.len(), 2);
        assert_eq!(
            (waits[0].start_ns, waits[0].dur_ns, waits[0].holder_tid),
            (MS, 5 * MS, 11)
        );
        assert_eq!((waits[0].holder_stack, waits[0].waiter_stack), (40, 41));
        assert!(waits[0].switch_wait);
        assert_eq!((waits[1].tid, waits[1].dur_ns), (12, MS));
        assert_eq!(p.written.gil_waits, 2);
    }

    #[test]
    fn gc_edges_pair_per_process_less_the_trap() {
        let mut p = pipe();
        p.gc_trap_ns = 1000;
        let t0 = p.start_ns;
        let before = abi::GcStats {
            collections: [4, 2, 1],
            collected: [10, 20, 30],
            ..Default::default()
        };
        let after = abi::GcStats {
            collections: [5, 3, 1],
            collected: [10, 29, 30],
            ..Default::default()
        };
        p.gc_edge(1, 10, t0 + MS, 1, before).unwrap();
        p.gc_edge(1, 11, t0 + 2 * MS, 1, after).unwrap(); // nested start: the first one counts
        p.gc_edge(1, 10, t0 + 4 * MS, 0, after).unwrap();
        p.gc_edge(1, 10, t0 + 5 * MS, 0, after).unwrap(); // end with none open: nothing
        let pauses: Vec<GcPause> = p
            .writer
            .iter()
            .filter_map(|e| match e {
                Event::GcPause(g) => Some(*g),
                _ => None,
            })
            .collect();
        assert_eq!(pauses.len(), 1);
        let g = pauses[0];
        assert_eq!((g.tid, g.start_ns, g.dur_ns), (10, MS, 3 * MS - 1000));
        assert_eq!((g.generation, g.collected), (1, 9));
    }

    #[test]
    fn gc_uprobe_calls_pair_without_the_trap_and_skip_empty_calls() {
        let mut p = pipe();
        p.gc_trap_ns = 1000;
        p.gc_uprobe_pids.insert(1);
        let t0 = p.start_ns;
        let s = |c0: u64, arg: i64| abi::GcStats {
            collections: [c0, 2, 1],
            collected: [10, 20, 30],
            generation_arg: arg,
        };
        // A call that collected nothing (3.13's gc_collect_main with no generation due).
        p.gc_edge(1, 10, t0 + MS, 1, s(4, -1)).unwrap();
        p.gc_edge(1, 10, t0 + 2 * MS, 0, s(4, -1)).unwrap();
        // A young collection.
        p.gc_edge(1, 10, t0 + 3 * MS, 1, s(4, 0)).unwrap();
        p.gc_edge(1, 10, t0 + 5 * MS, 0, s(5, -1)).unwrap();
        // Statistics unknown (all zero): the argument gives the generation.
        p.gc_edge(
            2,
            20,
            t0 + 6 * MS,
            1,
            abi::GcStats {
                generation_arg: 2,
                ..Default::default()
            },
        )
        .unwrap();
        p.gc_uprobe_pids.insert(2);
        p.gc_edge(2, 20, t0 + 7 * MS, 0, abi::GcStats::default())
            .unwrap();
        let pauses: Vec<GcPause> = p
            .writer
            .iter()
            .filter_map(|e| match e {
                Event::GcPause(g) => Some(*g),
                _ => None,
            })
            .collect();
        assert_eq!(pauses.len(), 2, "{pauses:?}");
        assert_eq!(
            (pauses[0].start_ns, pauses[0].dur_ns, pauses[0].generation),
            (3 * MS, 2 * MS, 0)
        );
        assert_eq!(
            (pauses[1].dur_ns, pauses[1].generation, pauses[1].collected),
            (MS, 2, -1)
        );
        assert_eq!(p.written.gc_calls_without_collection, 1);
    }
}
