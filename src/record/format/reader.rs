//! Reading records back, incrementally (`top` follows a file being written): the reader
//! dispatches on each record's tag to its [`super::layout`] and checks what it refers to.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context};

use super::layout::{
    CallHistRec, FrameRec, GcHistRec, GilWaitSumRec, IntervalRec, Layout, OffCpuRunRec,
    OffCpuSumRec, SampleRec, SamplesRec, StackRec,
};
use super::{aggregated_count, tag, Cur, MAGIC, VERSION};
use crate::record::model::*;
use crate::record::profile;

/// Read a whole recording. A file cut short inside a record (killed recorder) reads up to the
/// last complete record and sets `truncated`.
pub fn read_recording(path: &Path) -> anyhow::Result<Recording> {
    let mut data = Vec::new();
    std::fs::File::open(path)
        .with_context(|| format!("opening {}", path.display()))?
        .read_to_end(&mut data)?;
    parse_recording(&data).with_context(|| format!("reading recording {}", path.display()))
}

pub fn parse_recording(data: &[u8]) -> anyhow::Result<Recording> {
    let mut rd = RecordingReader::default();
    rd.feed(data)?;
    if !rd.saw_meta {
        bail!("recording has no header record");
    }
    if !rd.recording.profile_intervals.is_empty() {
        // Aggregated intervals are written when they end, after raw events of later times.
        let r = &mut rd.recording;
        r.samples.sort_by_key(|s| s.t_ns);
        r.offcpu.sort_by_key(|o| o.start_ns);
        r.gil_waits.sort_by_key(|g| g.start_ns);
        r.calls.sort_by_key(|c| c.start_ns);
    }
    rd.recording.truncated = rd.pending > 0;
    Ok(rd.recording)
}

/// Reads a recording incrementally, as its writer appends to it: `top` follows a live
/// recording (or replays a finished one) with this. Bytes that do not yet form a whole record
/// are kept until the next `feed`.
#[derive(Default)]
pub struct RecordingReader {
    pub recording: Recording,
    tail: Vec<u8>,
    header_done: bool,
    saw_meta: bool,
    last_sample_ns: u64,
    /// Bytes waiting for the rest of their record.
    pending: usize,
    /// The interval the aggregated records being read belong to.
    interval: Option<(u64, u64)>,
    /// Await chains of record 18 by id ([`super::TaskWire`]).
    task_chains: HashMap<u32, Vec<String>>,
}

impl RecordingReader {
    /// Whether the header record has been read.
    pub fn has_meta(&self) -> bool {
        self.saw_meta
    }

    /// Append bytes and apply every complete record in them. Returns how many records were
    /// applied.
    pub fn feed(&mut self, data: &[u8]) -> anyhow::Result<usize> {
        let mut owned = std::mem::take(&mut self.tail);
        let buf: &[u8] = if owned.is_empty() {
            data
        } else {
            owned.extend_from_slice(data);
            &owned
        };
        let mut i = 0;
        if !self.header_done {
            if buf.len() < 8 {
                self.tail = buf.to_vec();
                self.pending = self.tail.len();
                return Ok(0);
            }
            if &buf[..6] != MAGIC {
                bail!("not an enginescope recording (bad magic)");
            }
            let version = u16::from_le_bytes([buf[6], buf[7]]);
            if version != VERSION {
                bail!(
                    "recording format version {version}; this enginescope reads version {VERSION}"
                );
            }
            self.header_done = true;
            i = 8;
        }
        let mut n = 0;
        while i < buf.len() {
            let t = buf[i];
            let mut head = Cur { b: buf, i: i + 1 };
            let Ok(len) = head.varint() else { break };
            let start = head.i;
            let Some(end) = usize::try_from(len)
                .ok()
                .and_then(|l| start.checked_add(l))
                .filter(|&e| e <= buf.len())
            else {
                break;
            };
            self.apply(t, &buf[start..end])?;
            i = end;
            n += 1;
        }
        // Keep the unread rest. Fed a few bytes at a time, a large record is appended to in
        // place rather than copied again on every feed.
        if owned.is_empty() {
            self.tail = data[i..].to_vec();
        } else {
            owned.drain(..i);
            self.tail = owned;
        }
        self.pending = self.tail.len();
        Ok(n)
    }

    /// One record: its tag says its type; binary payloads read by their [`layout`], then what
    /// they refer to is checked against the tables read so far.
    fn apply(&mut self, t: u8, p: &[u8]) -> anyhow::Result<()> {
        let r = &mut self.recording;
        let c = &mut Cur { b: p, i: 0 };
        match t {
            tag::META => {
                r.meta = serde_json::from_slice(p)?;
                self.saw_meta = true;
            }
            tag::PROCESS => r.processes.push(serde_json::from_slice(p)?),
            tag::THREAD => r.threads.push(serde_json::from_slice(p)?),
            tag::TASK => {
                let wire: super::TaskWire = serde_json::from_slice(p)?;
                r.task_changes.push(wire.resolve(&mut self.task_chains));
            }
            tag::COUNTERS => {
                let m: std::collections::BTreeMap<String, u64> = serde_json::from_slice(p)?;
                r.counters.extend(m);
            }
            tag::END => r.end = Some(serde_json::from_slice(p)?),
            tag::ENGINE => r.engines.push(serde_json::from_slice(p)?),
            tag::SERIES => {
                let m: MetricSeries = serde_json::from_slice(p)?;
                if m.id as usize != r.series.len() {
                    bail!("metric series id {} out of order", m.id);
                }
                r.series.push(m);
            }
            tag::SCRAPE_ERROR => r.scrape_errors.push(serde_json::from_slice(p)?),
            tag::PROBE => {
                let pr: ProbeInfo = serde_json::from_slice(p)?;
                if pr.id as usize != r.probes.len() {
                    bail!("probe id {} out of order", pr.id);
                }
                r.probes.push(pr);
            }
            tag::GC_METHOD => r.gc_methods.push(serde_json::from_slice(p)?),
            tag::FRAME => self.frame(FrameRec::get(c)?)?,
            tag::STACK => self.stack(StackRec::get(c)?)?,
            tag::SAMPLE => self.sample(SampleRec::get(c)?)?,
            tag::OFFCPU => {
                let o = OffCpu::get(c)?;
                self.known_stacks(&[o.stack], "an off-CPU interval")?;
                self.recording.offcpu.push(o);
            }
            tag::GIL_WAIT => {
                let g = GilWait::get(c)?;
                self.known_stacks(&[g.holder_stack, g.waiter_stack], "a GIL wait")?;
                self.recording.gil_waits.push(g);
            }
            tag::WAKE => {
                let w = Wake::get(c)?;
                self.known_stacks(&[w.waker_stack], "a wake-up")?;
                self.recording.wakes.push(w);
            }
            tag::GC_PAUSE => r.gc_pauses.push(GcPause::get(c)?),
            tag::METRIC => {
                let m = MetricPoint::get(c)?;
                if m.series as usize >= r.series.len() {
                    bail!("metric names unknown series {}", m.series);
                }
                r.metrics.push(m);
            }
            tag::CALL => {
                let call = FunctionCall::get(c)?;
                self.known_probe(call.probe, "call")?;
                self.recording.calls.push(call);
            }
            tag::PROBE_WATCH => {
                let w = ProbeWatch::get(c)?;
                self.known_probe(w.probe, "probe watch")?;
                self.recording.probe_watches.push(w);
            }
            tag::INTERVAL => {
                let IntervalRec { start_ns, end_ns } = IntervalRec::get(c)?;
                if end_ns < start_ns {
                    bail!("interval ends before it starts");
                }
                self.interval = Some((start_ns, end_ns));
                r.profile_intervals.push((start_ns, end_ns));
            }
            tag::SAMPLES => self.samples_sum(SamplesRec::get(c)?)?,
            tag::OFFCPU_SUM => self.offcpu_sum(OffCpuSumRec::get(c)?)?,
            tag::OFFCPU_RUN => self.offcpu_run(OffCpuRunRec::get(c)?)?,
            tag::GIL_WAIT_SUM => self.gil_wait_sum(GilWaitSumRec::get(c)?)?,
            tag::CALL_HIST => self.call_hist(CallHistRec::get(c)?)?,
            tag::GC_HIST => self.gc_hist(GcHistRec::get(c)?)?,
            // Unknown tags are skipped: newer writers may add record kinds.
            _ => {}
        }
        Ok(())
    }

    fn known_stacks(&self, ids: &[u32], what: &str) -> anyhow::Result<()> {
        let n = self.recording.stacks.len();
        match ids.iter().find(|&&s| s as usize >= n) {
            Some(s) => bail!("{what} names unknown stack {s}"),
            None => Ok(()),
        }
    }

    fn known_probe(&self, probe: u32, what: &str) -> anyhow::Result<()> {
        if probe as usize >= self.recording.probes.len() {
            bail!("{what} names unknown probe {probe}");
        }
        Ok(())
    }

    /// The interval an aggregated record belongs to.
    fn interval(&self, what: &str) -> anyhow::Result<(u64, u64)> {
        self.interval
            .with_context(|| format!("aggregated {what} before an interval"))
    }

    fn frame(&mut self, f: FrameRec) -> anyhow::Result<()> {
        let r = &mut self.recording;
        if f.id != r.frames.len() as u64 {
            bail!("frame id {} out of order", f.id);
        }
        if let Some(n) = f.native {
            r.frame_native.insert(f.id as u32, n);
        }
        r.frames.push(Frame {
            function: f.function,
            file: f.file,
            line: f.line,
        });
        Ok(())
    }

    fn stack(&mut self, s: StackRec) -> anyhow::Result<()> {
        let r = &mut self.recording;
        if s.id != r.stacks.len() as u64 {
            bail!("bad stack record {}", s.id);
        }
        if let Some(f) = s.frames.iter().find(|&&f| f as usize >= r.frames.len()) {
            bail!("stack {} names unknown frame {f}", s.id);
        }
        r.stacks.push(s.frames);
        Ok(())
    }

    fn sample(&mut self, s: SampleRec) -> anyhow::Result<()> {
        self.last_sample_ns = self
            .last_sample_ns
            .checked_add_signed(s.delta_ns)
            .context("sample time out of range")?;
        self.known_stacks(&[s.stack], "a sample")?;
        self.recording.samples.push(Sample {
            t_ns: self.last_sample_ns,
            pid: s.pid,
            tid: s.tid,
            stack: s.stack,
            flags: s.flags,
            weight_ns: s.weight_ns,
        });
        Ok(())
    }

    fn samples_sum(&mut self, a: SamplesRec) -> anyhow::Result<()> {
        let (start, end) = self.interval("samples")?;
        let count = aggregated_count(a.count)?;
        self.known_stacks(&[a.key.stack], "aggregated samples")?;
        for i in 0..count {
            self.recording.samples.push(Sample {
                t_ns: profile::spread(start, end, count, i),
                pid: a.key.pid,
                tid: a.key.tid,
                stack: a.key.stack,
                flags: a.key.flags,
                weight_ns: profile::part(a.weight_ns, count, i).min(u32::MAX as u64) as u32,
            });
        }
        Ok(())
    }

    fn offcpu_sum(&mut self, a: OffCpuSumRec) -> anyhow::Result<()> {
        let (start, end) = self.interval("off-CPU")?;
        let count = aggregated_count(a.count)?;
        self.known_stacks(&[a.key.stack], "aggregated off-CPU")?;
        for i in 0..count {
            let dur_ns = profile::part(a.dur_ns, count, i);
            self.recording.offcpu.push(OffCpu {
                pid: a.key.pid,
                tid: a.key.tid,
                start_ns: profile::ended_by(start, end, count, i, dur_ns),
                dur_ns,
                stack: a.key.stack,
                preempted: a.key.preempted,
                stolen: a.key.stolen,
            });
        }
        Ok(())
    }

    /// Record 28: the run's intervals, back to back from its start, their sum split equally.
    fn offcpu_run(&mut self, r: OffCpuRunRec) -> anyhow::Result<()> {
        let count = aggregated_count(r.count)?;
        self.known_stacks(&[r.run.stack], "a run of off-CPU intervals")?;
        let mut start = r.run.start_ns;
        for i in 0..count {
            let dur_ns = profile::part(r.run.dur_ns, count, i);
            self.recording.offcpu.push(OffCpu {
                start_ns: start,
                dur_ns,
                ..r.run
            });
            start = start.saturating_add(dur_ns);
        }
        Ok(())
    }

    fn gil_wait_sum(&mut self, a: GilWaitSumRec) -> anyhow::Result<()> {
        let (start, end) = self.interval("GIL waits")?;
        let count = aggregated_count(a.count)?;
        self.known_stacks(
            &[a.key.holder_stack, a.key.waiter_stack],
            "aggregated GIL waits",
        )?;
        for i in 0..count {
            let dur_ns = profile::part(a.dur_ns, count, i);
            self.recording.gil_waits.push(GilWait {
                pid: a.key.pid,
                tid: a.key.tid,
                start_ns: profile::ended_by(start, end, count, i, dur_ns),
                dur_ns,
                holder_tid: a.key.holder_tid,
                holder_stack: a.key.holder_stack,
                waiter_stack: a.key.waiter_stack,
                switch_wait: a.key.switch_wait,
            });
        }
        Ok(())
    }

    fn gc_hist(&mut self, a: GcHistRec) -> anyhow::Result<()> {
        let (start, end) = self.interval("GC pauses")?;
        let count = aggregated_count(a.count)?;
        if a.buckets.iter().try_fold(0u64, |t, b| t.checked_add(b.1)) != Some(count) {
            bail!("aggregated GC pauses: buckets hold other than the count");
        }
        let durs = profile::hist_durations(&a.buckets, a.sum_ns);
        for (i, dur_ns) in (0u64..).zip(durs) {
            self.recording.gc_pauses.push(GcPause {
                pid: a.key.pid,
                tid: a.key.tid,
                start_ns: profile::ended_by(start, end, count, i, dur_ns),
                dur_ns,
                generation: a.key.generation,
                collected: if a.collected < 0 {
                    -1
                } else {
                    profile::part(a.collected as u64, count, i) as i64
                },
            });
        }
        Ok(())
    }

    fn call_hist(&mut self, a: CallHistRec) -> anyhow::Result<()> {
        let (start, end) = self.interval("calls")?;
        let count = aggregated_count(a.count)?;
        self.known_probe(a.key.probe, "aggregated calls")?;
        let mut i = 0u64;
        for (b, k) in a.buckets {
            if i.checked_add(k).is_none_or(|t| t > count) {
                bail!("aggregated calls: buckets hold more calls than the count");
            }
            let dur_ns = profile::bucket_value(b);
            for _ in 0..k {
                self.recording.calls.push(FunctionCall {
                    start_ns: profile::ended_by(start, end, count, i, dur_ns),
                    dur_ns,
                    pid: a.key.pid,
                    tid: a.key.tid,
                    probe: a.key.probe,
                });
                i += 1;
            }
        }
        Ok(())
    }
}
