//! Hand-built recordings with known answers, for unit tests over the views, the dashboard
//! and the agent: one builder instead of a `Recording` filled in field by field in each test.

use crate::record::{
    flags, Frame, FunctionCall, GcPause, GilWait, OffCpu, ProbeInfo, ProcessInfo, Recording,
    Sample, ThreadInfo, Wake,
};

pub const MS: u64 = 1_000_000;
pub const S: u64 = 1_000_000_000;

/// Builds a recording event by event.
pub(crate) struct Rec(pub Recording);

impl Default for Rec {
    fn default() -> Self {
        Self::new()
    }
}

impl Rec {
    pub fn new() -> Self {
        let mut r = Recording {
            stacks: vec![vec![]],
            ..Recording::default()
        };
        r.meta.backend = "bpf".into();
        r.meta.rate_hz = 1000;
        Rec(r)
    }

    pub fn process(mut self, pid: i32, cmdline: &str, role: &str) -> Self {
        self.0.processes.push(ProcessInfo {
            pid,
            cmdline: cmdline.into(),
            python_version: "3.12.1".into(),
            role: role.into(),
        });
        self
    }

    pub fn thread(mut self, pid: i32, tid: i32, name: &str) -> Self {
        self.0.threads.push(ThreadInfo {
            pid,
            tid,
            name: name.into(),
            t_ns: 0,
            python_name: None,
        });
        self
    }

    /// A stack of functions (innermost first) in `file`; returns its id.
    pub fn stack(&mut self, functions: &[&str], file: &str) -> u32 {
        let frames: Vec<(&str, &str)> = functions.iter().map(|f| (*f, file)).collect();
        self.stack_in(&frames)
    }

    /// A stack of (function, file) frames, innermost first; returns its id.
    pub(crate) fn stack_in(&mut self, frames: &[(&str, &str)]) -> u32 {
        let mut ids = Vec::new();
        for (f, file) in frames {
            let frame = Frame {
                function: f.to_string(),
                file: file.to_string(),
                line: Some(1),
            };
            let id = match self.0.frames.iter().position(|x| *x == frame) {
                Some(i) => i,
                None => {
                    self.0.frames.push(frame);
                    self.0.frames.len() - 1
                }
            };
            ids.push(id as u32);
        }
        self.0.stacks.push(ids);
        (self.0.stacks.len() - 1) as u32
    }

    /// `n` samples of `weight` each, one every `weight` from `start`.
    pub fn samples(
        &mut self,
        (pid, tid): (i32, i32),
        start: u64,
        n: u64,
        weight: u64,
        stack: u32,
        fl: u8,
    ) {
        for i in 0..n {
            self.0.samples.push(Sample {
                t_ns: start + i * weight,
                pid,
                tid,
                stack,
                flags: fl,
                weight_ns: weight as u32,
            });
        }
    }

    pub fn offcpu(&mut self, pid: i32, tid: i32, start: u64, dur: u64) {
        self.offcpu_at((pid, tid), start, dur, 0, false);
    }

    /// An off-CPU interval at `stack`, blocked or preempted.
    pub(crate) fn offcpu_at(
        &mut self,
        (pid, tid): (i32, i32),
        start: u64,
        dur: u64,
        stack: u32,
        preempted: bool,
    ) {
        self.0.offcpu.push(OffCpu {
            pid,
            tid,
            start_ns: start,
            dur_ns: dur,
            stack,
            preempted,
            stolen: false,
        });
    }

    /// Thread `tid` woken at `t` by `waker_tid`, which was running `waker_stack`.
    pub fn wake(&mut self, (pid, tid): (i32, i32), t: u64, waker_tid: i32, waker_stack: u32) {
        self.0.wakes.push(Wake {
            t_ns: t,
            pid,
            tid,
            waker_tid,
            waker_stack,
        });
    }

    pub fn gil_wait(
        &mut self,
        pid: i32,
        tid: i32,
        start: u64,
        dur: u64,
        holder: i32,
        holder_stack: u32,
    ) {
        self.0.gil_waits.push(GilWait {
            pid,
            tid,
            start_ns: start,
            dur_ns: dur,
            holder_tid: holder,
            holder_stack,
            waiter_stack: 0,
            switch_wait: false,
        });
    }

    /// The last GIL wait added, waiting at `stack`.
    pub(crate) fn waiting_at(&mut self, stack: u32) {
        if let Some(g) = self.0.gil_waits.last_mut() {
            g.waiter_stack = stack;
        }
    }

    pub fn gc(&mut self, pid: i32, tid: i32, start: u64, dur: u64, generation: i8) {
        self.0.gc_pauses.push(GcPause {
            pid,
            tid,
            start_ns: start,
            dur_ns: dur,
            generation,
            collected: 10,
        });
    }

    pub fn probe(&mut self, pid: i32, spec: &str, function: &str, method: &str) -> u32 {
        let id = self.0.probes.len() as u32;
        self.0.probes.push(ProbeInfo {
            id,
            spec: spec.into(),
            pid,
            function: function.into(),
            file: "x.py".into(),
            firstlineno: 1,
            method: method.into(),
            resolution_ns: 1000,
            t_ns: 0,
        });
        id
    }

    pub fn call(&mut self, probe: u32, pid: i32, tid: i32, start: u64, dur: u64) {
        self.0.calls.push(FunctionCall {
            probe,
            pid,
            tid,
            start_ns: start,
            dur_ns: dur,
        });
    }
}

pub const GIL: u8 = flags::GIL;
