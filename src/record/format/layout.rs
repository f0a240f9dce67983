//! The byte layout of each binary record, written once: every type's encoder beside its
//! decoder (docs/recording-format.md lists the same fields). The writer puts a record with
//! [`Layout::put`] and the reader dispatches on the tag to [`Layout::get`]; what a field
//! refers to (a stack id, a probe id) is checked by the reader, which knows the tables.
//! JSON records (meta, processes, threads, engines, …) are their `serde` types.

use anyhow::bail;

use super::{put_str, put_varint, tag, unzigzag, zigzag, Cur};
use crate::record::model::{
    FunctionCall, GcPause, GilWait, MetricPoint, NativeFrameInfo, OffCpu, ProbeWatch, Wake,
};
use crate::record::profile::{CallKey, GcKey, GilKey, OffCpuKey, SampleKey};

/// One record type's payload.
pub(super) trait Layout: Sized {
    const TAG: u8;
    fn put(&self, out: &mut Vec<u8>);
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self>;
}

fn put_i32(out: &mut Vec<u8>, v: i32) {
    put_varint(out, zigzag(i64::from(v)));
}

/// Record 4: a frame's definition, its id the next in the table. A native frame's four
/// fields trail (readers before them stop after `file`).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct FrameRec {
    pub id: u64,
    pub line: Option<i32>,
    pub function: String,
    pub file: String,
    pub native: Option<NativeFrameInfo>,
}

impl Layout for FrameRec {
    const TAG: u8 = tag::FRAME;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.id);
        put_varint(
            out,
            self.line.map(|l| zigzag(i64::from(l)) + 1).unwrap_or(0),
        );
        put_str(out, &self.function);
        put_str(out, &self.file);
        if let Some(n) = &self.native {
            out.push(n.kind);
            put_varint(out, n.addr);
            put_str(out, &n.module);
            put_str(out, &n.build_id);
        }
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        let id = c.varint()?;
        let line = c.varint()?;
        let function = c.str()?;
        let file = c.str()?;
        let native = if c.i < c.b.len() {
            Some(NativeFrameInfo {
                kind: c.u8()?,
                addr: c.varint()?,
                module: c.str()?,
                build_id: c.str()?,
            })
        } else {
            None
        };
        Ok(FrameRec {
            id,
            line: if line == 0 {
                None
            } else {
                i32::try_from(unzigzag(line - 1)).ok()
            },
            function,
            file,
            native,
        })
    }
}

/// Record 5: a stack's definition, frame ids innermost first.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct StackRec {
    pub id: u64,
    pub frames: Vec<u32>,
}

impl Layout for StackRec {
    const TAG: u8 = tag::STACK;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.id);
        put_varint(out, self.frames.len() as u64);
        for &f in &self.frames {
            put_varint(out, u64::from(f));
        }
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        let id = c.varint()?;
        let n = c.varint()?;
        // Each frame id takes at least a byte: a count beyond the payload is corrupt.
        if n > c.b.len() as u64 {
            bail!("bad stack record {id}");
        }
        let frames = (0..n)
            .map(|_| c.varint().map(|f| f as u32))
            .collect::<anyhow::Result<Vec<u32>>>()?;
        Ok(StackRec { id, frames })
    }
}

/// Record 6: a sample, its time a signed delta from the previous sample's (samples from
/// several CPUs can be slightly out of order): 2-3 bytes instead of 5-6.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SampleRec {
    pub delta_ns: i64,
    pub pid: i32,
    pub tid: i32,
    pub stack: u32,
    pub flags: u8,
    pub weight_ns: u32,
}

impl Layout for SampleRec {
    const TAG: u8 = tag::SAMPLE;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, zigzag(self.delta_ns));
        put_i32(out, self.pid);
        put_i32(out, self.tid);
        put_varint(out, u64::from(self.stack));
        out.push(self.flags);
        put_varint(out, u64::from(self.weight_ns));
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(SampleRec {
            delta_ns: unzigzag(c.varint()?),
            pid: c.i32()?,
            tid: c.i32()?,
            stack: c.varint()? as u32,
            flags: c.u8()?,
            weight_ns: c.varint()? as u32,
        })
    }
}

/// An off-CPU interval's state byte: 0 blocked, 1 preempted, 2 taken by the hypervisor while
/// on CPU (stolen; older readers read any non-zero byte as preempted, which it also is).
fn off_state(preempted: bool, stolen: bool) -> u8 {
    if stolen {
        2
    } else {
        u8::from(preempted)
    }
}

/// (preempted, stolen) of a state byte.
fn off_state_of(b: u8) -> (bool, bool) {
    (b != 0, b == 2)
}

/// Record 7.
impl Layout for OffCpu {
    const TAG: u8 = tag::OFFCPU;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.start_ns);
        put_varint(out, self.dur_ns);
        put_i32(out, self.pid);
        put_i32(out, self.tid);
        put_varint(out, u64::from(self.stack));
        out.push(off_state(self.preempted, self.stolen));
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        let (start_ns, dur_ns, pid, tid) = (c.varint()?, c.varint()?, c.i32()?, c.i32()?);
        let stack = c.varint()? as u32;
        let (preempted, stolen) = off_state_of(c.u8()?);
        Ok(OffCpu {
            start_ns,
            dur_ns,
            pid,
            tid,
            stack,
            preempted,
            stolen,
        })
    }
}

/// Record 10.
impl Layout for GilWait {
    const TAG: u8 = tag::GIL_WAIT;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.start_ns);
        put_varint(out, self.dur_ns);
        put_i32(out, self.pid);
        put_i32(out, self.tid);
        put_i32(out, self.holder_tid);
        put_varint(out, u64::from(self.holder_stack));
        put_varint(out, u64::from(self.waiter_stack));
        out.push(u8::from(self.switch_wait));
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(GilWait {
            start_ns: c.varint()?,
            dur_ns: c.varint()?,
            pid: c.i32()?,
            tid: c.i32()?,
            holder_tid: c.i32()?,
            holder_stack: c.varint()? as u32,
            waiter_stack: c.varint()? as u32,
            switch_wait: c.u8()? != 0,
        })
    }
}

/// Record 26.
impl Layout for Wake {
    const TAG: u8 = tag::WAKE;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.t_ns);
        put_i32(out, self.pid);
        put_i32(out, self.tid);
        put_i32(out, self.waker_tid);
        put_varint(out, u64::from(self.waker_stack));
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(Wake {
            t_ns: c.varint()?,
            pid: c.i32()?,
            tid: c.i32()?,
            waker_tid: c.i32()?,
            waker_stack: c.varint()? as u32,
        })
    }
}

/// Record 11. `collected` was added after the first files of version 1 were written: absent
/// reads as -1 (unknown).
impl Layout for GcPause {
    const TAG: u8 = tag::GC_PAUSE;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.start_ns);
        put_varint(out, self.dur_ns);
        put_i32(out, self.pid);
        put_i32(out, self.tid);
        put_varint(out, zigzag(i64::from(self.generation)));
        put_varint(out, zigzag(self.collected));
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(GcPause {
            start_ns: c.varint()?,
            dur_ns: c.varint()?,
            pid: c.i32()?,
            tid: c.i32()?,
            generation: i8::try_from(unzigzag(c.varint()?)).unwrap_or(-1),
            collected: c.varint().map(unzigzag).unwrap_or(-1),
        })
    }
}

/// Record 14: a metric point, its value 8 bytes little-endian.
impl Layout for MetricPoint {
    const TAG: u8 = tag::METRIC;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.t_ns);
        put_varint(out, u64::from(self.series));
        out.extend_from_slice(&self.value.to_le_bytes());
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        let t_ns = c.varint()?;
        let series = c.varint()? as u32;
        let bytes: [u8; 8] =
            c.b.get(c.i..c.i + 8)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| anyhow::anyhow!("metric value cut short"))?;
        c.i += 8;
        Ok(MetricPoint {
            t_ns,
            series,
            value: f64::from_le_bytes(bytes),
        })
    }
}

/// Record 17: one probed call.
impl Layout for FunctionCall {
    const TAG: u8 = tag::CALL;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.start_ns);
        put_varint(out, self.dur_ns);
        put_i32(out, self.pid);
        put_i32(out, self.tid);
        put_varint(out, u64::from(self.probe));
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(FunctionCall {
            start_ns: c.varint()?,
            dur_ns: c.varint()?,
            pid: c.i32()?,
            tid: c.i32()?,
            probe: c.varint()? as u32,
        })
    }
}

/// Record 20: an exact probe's watch set on (1) or removed (0).
impl Layout for ProbeWatch {
    const TAG: u8 = tag::PROBE_WATCH;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.t_ns);
        put_varint(out, u64::from(self.probe));
        put_i32(out, self.tid);
        out.push(u8::from(self.on));
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(ProbeWatch {
            t_ns: c.varint()?,
            probe: c.varint()? as u32,
            tid: c.i32()?,
            on: c.u8()? != 0,
        })
    }
}

/// Record 21: the interval the aggregated records after it add up.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct IntervalRec {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Layout for IntervalRec {
    const TAG: u8 = tag::INTERVAL;
    fn put(&self, out: &mut Vec<u8>) {
        put_varint(out, self.start_ns);
        put_varint(out, self.end_ns);
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(IntervalRec {
            start_ns: c.varint()?,
            end_ns: c.varint()?,
        })
    }
}

/// Record 22: samples of one thread, stack and flags added up over the interval.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SamplesRec {
    pub key: SampleKey,
    pub count: u64,
    pub weight_ns: u64,
}

impl Layout for SamplesRec {
    const TAG: u8 = tag::SAMPLES;
    fn put(&self, out: &mut Vec<u8>) {
        let k = &self.key;
        put_i32(out, k.pid);
        put_i32(out, k.tid);
        put_varint(out, u64::from(k.stack));
        out.push(k.flags);
        put_varint(out, self.count);
        put_varint(out, self.weight_ns);
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(SamplesRec {
            key: SampleKey {
                pid: c.i32()?,
                tid: c.i32()?,
                stack: c.varint()? as u32,
                flags: c.u8()?,
            },
            count: c.varint()?,
            weight_ns: c.varint()?,
        })
    }
}

/// Record 23: off-CPU intervals of one thread and stack added up over the interval.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct OffCpuSumRec {
    pub key: OffCpuKey,
    pub count: u64,
    pub dur_ns: u64,
}

impl Layout for OffCpuSumRec {
    const TAG: u8 = tag::OFFCPU_SUM;
    fn put(&self, out: &mut Vec<u8>) {
        let k = &self.key;
        put_i32(out, k.pid);
        put_i32(out, k.tid);
        put_varint(out, u64::from(k.stack));
        out.push(off_state(k.preempted, k.stolen));
        put_varint(out, self.count);
        put_varint(out, self.dur_ns);
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        let (pid, tid, stack) = (c.i32()?, c.i32()?, c.varint()? as u32);
        let (preempted, stolen) = off_state_of(c.u8()?);
        Ok(OffCpuSumRec {
            key: OffCpuKey {
                pid,
                tid,
                stack,
                preempted,
                stolen,
            },
            count: c.varint()?,
            dur_ns: c.varint()?,
        })
    }
}

/// Record 28: `count` off-CPU intervals of one thread and stack, one after another between
/// two of its samples, as one: from the first one's start, lasting their sum.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OffCpuRunRec {
    pub run: OffCpu,
    pub count: u64,
}

impl Layout for OffCpuRunRec {
    const TAG: u8 = tag::OFFCPU_RUN;
    fn put(&self, out: &mut Vec<u8>) {
        self.run.put(out);
        put_varint(out, self.count);
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(OffCpuRunRec {
            run: OffCpu::get(c)?,
            count: c.varint()?,
        })
    }
}

/// Record 24: GIL waits of one thread behind one holder and stacks, added up.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct GilWaitSumRec {
    pub key: GilKey,
    pub count: u64,
    pub dur_ns: u64,
}

impl Layout for GilWaitSumRec {
    const TAG: u8 = tag::GIL_WAIT_SUM;
    fn put(&self, out: &mut Vec<u8>) {
        let k = &self.key;
        put_i32(out, k.pid);
        put_i32(out, k.tid);
        put_i32(out, k.holder_tid);
        put_varint(out, u64::from(k.holder_stack));
        put_varint(out, u64::from(k.waiter_stack));
        out.push(u8::from(k.switch_wait));
        put_varint(out, self.count);
        put_varint(out, self.dur_ns);
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        Ok(GilWaitSumRec {
            key: GilKey {
                pid: c.i32()?,
                tid: c.i32()?,
                holder_tid: c.i32()?,
                holder_stack: c.varint()? as u32,
                waiter_stack: c.varint()? as u32,
                switch_wait: c.u8()? != 0,
            },
            count: c.varint()?,
            dur_ns: c.varint()?,
        })
    }
}

/// Record 25: a probe's calls on one thread over the interval, as a histogram: buckets
/// (`record::profile`'s, ascending, each written as the step from the one before) with
/// their counts.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct CallHistRec {
    pub key: CallKey,
    pub count: u64,
    pub sum_ns: u64,
    pub buckets: Vec<(u32, u64)>,
}

impl Layout for CallHistRec {
    const TAG: u8 = tag::CALL_HIST;
    fn put(&self, out: &mut Vec<u8>) {
        let k = &self.key;
        put_i32(out, k.pid);
        put_i32(out, k.tid);
        put_varint(out, u64::from(k.probe));
        put_varint(out, self.count);
        put_varint(out, self.sum_ns);
        put_buckets(out, &self.buckets);
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        let key = CallKey {
            pid: c.i32()?,
            tid: c.i32()?,
            probe: c.varint()? as u32,
        };
        let count = c.varint()?;
        let sum_ns = c.varint()?;
        let buckets = get_buckets(c, "call")?;
        Ok(CallHistRec {
            key,
            count,
            sum_ns,
            buckets,
        })
    }
}

/// Buckets ascending, each written as the step from the one before, with their counts.
fn put_buckets(out: &mut Vec<u8>, buckets: &[(u32, u64)]) {
    put_varint(out, buckets.len() as u64);
    let mut prev = 0u32;
    for &(b, n) in buckets {
        put_varint(out, u64::from(b.wrapping_sub(prev)));
        put_varint(out, n);
        prev = b;
    }
}

fn get_buckets(c: &mut Cur<'_>, what: &str) -> anyhow::Result<Vec<(u32, u64)>> {
    let n = c.varint()?;
    if n > c.b.len() as u64 {
        bail!("bad aggregated {what} record");
    }
    let mut buckets = Vec::with_capacity(n as usize);
    let mut b = 0u64;
    for _ in 0..n {
        b = b
            .checked_add(c.varint()?)
            .filter(|&b| b <= u64::from(u32::MAX))
            .ok_or_else(|| anyhow::anyhow!("bucket out of range"))?;
        buckets.push((b as u32, c.varint()?));
    }
    Ok(buckets)
}

/// Record 27: one thread's collections of one generation over the interval, as a histogram of
/// pause durations (the buckets of record 25), with their exact sum and the objects freed.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct GcHistRec {
    pub key: GcKey,
    pub count: u64,
    pub sum_ns: u64,
    /// -1: unknown.
    pub collected: i64,
    pub buckets: Vec<(u32, u64)>,
}

impl Layout for GcHistRec {
    const TAG: u8 = tag::GC_HIST;
    fn put(&self, out: &mut Vec<u8>) {
        let k = &self.key;
        put_i32(out, k.pid);
        put_i32(out, k.tid);
        put_varint(out, zigzag(i64::from(k.generation)));
        put_varint(out, self.count);
        put_varint(out, self.sum_ns);
        put_varint(out, zigzag(self.collected));
        put_buckets(out, &self.buckets);
    }
    fn get(c: &mut Cur<'_>) -> anyhow::Result<Self> {
        let key = GcKey {
            pid: c.i32()?,
            tid: c.i32()?,
            generation: i8::try_from(unzigzag(c.varint()?)).unwrap_or(-1),
        };
        Ok(GcHistRec {
            key,
            count: c.varint()?,
            sum_ns: c.varint()?,
            collected: unzigzag(c.varint()?),
            buckets: get_buckets(c, "GC")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip<L: Layout + PartialEq + std::fmt::Debug>(r: L) {
        let mut out = Vec::new();
        r.put(&mut out);
        let mut c = Cur { b: &out, i: 0 };
        let back = L::get(&mut c).unwrap();
        assert_eq!(back, r);
        assert_eq!(c.i, out.len(), "tag {}: bytes left unread", L::TAG);
        // Cut short anywhere, a record reads as an error or as its older, shorter form (the
        // trailing fields), never a panic.
        for cut in 0..out.len() {
            let _ = L::get(&mut Cur {
                b: &out[..cut],
                i: 0,
            });
        }
    }

    #[test]
    fn every_binary_record_reads_back_what_was_written() {
        roundtrip(FrameRec {
            id: 7,
            line: Some(-3),
            function: "f".into(),
            file: "x.py".into(),
            native: None,
        });
        roundtrip(FrameRec {
            id: 8,
            line: None,
            function: "memcpy".into(),
            file: "libc.so.6".into(),
            native: Some(NativeFrameInfo {
                kind: 2,
                addr: 0xdead_beef,
                module: "/lib/libc.so.6".into(),
                build_id: "ab12".into(),
            }),
        });
        roundtrip(StackRec {
            id: 3,
            frames: vec![0, 5, 300_000],
        });
        roundtrip(SampleRec {
            delta_ns: -12_345,
            pid: 100,
            tid: -1,
            stack: 4,
            flags: 0x85,
            weight_ns: u32::MAX,
        });
        roundtrip(OffCpu {
            start_ns: 1 << 40,
            dur_ns: 77,
            pid: 1,
            tid: 2,
            stack: 3,
            preempted: true,
            stolen: false,
        });
        roundtrip(OffCpu {
            start_ns: 5,
            dur_ns: 1_000_000,
            pid: 1,
            tid: 2,
            stack: 3,
            preempted: true,
            stolen: true,
        });
        roundtrip(GilWait {
            start_ns: 5,
            dur_ns: 6,
            pid: 7,
            tid: 8,
            holder_tid: -1,
            holder_stack: 9,
            waiter_stack: 10,
            switch_wait: true,
        });
        roundtrip(Wake {
            t_ns: 11,
            pid: 7,
            tid: 8,
            waker_tid: 9,
            waker_stack: 12,
        });
        roundtrip(GcPause {
            start_ns: 1,
            dur_ns: 2,
            pid: 3,
            tid: 4,
            generation: 2,
            collected: -1,
        });
        roundtrip(MetricPoint {
            t_ns: 9,
            series: 12,
            value: -0.125,
        });
        roundtrip(FunctionCall {
            start_ns: 3,
            dur_ns: 4,
            pid: 5,
            tid: 6,
            probe: 7,
        });
        roundtrip(ProbeWatch {
            t_ns: 8,
            probe: 9,
            tid: 10,
            on: true,
        });
        roundtrip(IntervalRec {
            start_ns: 10,
            end_ns: 20,
        });
        roundtrip(SamplesRec {
            key: SampleKey {
                pid: 1,
                tid: 2,
                stack: 3,
                flags: 4,
            },
            count: 5,
            weight_ns: 6,
        });
        roundtrip(OffCpuSumRec {
            key: OffCpuKey {
                pid: 1,
                tid: 2,
                stack: 3,
                preempted: true,
                stolen: true,
            },
            count: 5,
            dur_ns: 6,
        });
        roundtrip(GilWaitSumRec {
            key: GilKey {
                pid: 1,
                tid: 2,
                holder_tid: 3,
                holder_stack: 4,
                waiter_stack: 5,
                switch_wait: false,
            },
            count: 6,
            dur_ns: 7,
        });
        roundtrip(CallHistRec {
            key: CallKey {
                pid: 1,
                tid: 2,
                probe: 3,
            },
            count: 9,
            sum_ns: 1000,
            buckets: vec![(4, 2), (10, 3), (u32::MAX, 4)],
        });
        roundtrip(GcHistRec {
            key: GcKey {
                pid: 1,
                tid: 2,
                generation: -1,
            },
            count: 5,
            sum_ns: 123_456,
            collected: -1,
            buckets: vec![(40, 2), (300, 3)],
        });
    }

    #[test]
    fn a_gc_pause_without_its_later_field_reads_as_unknown() {
        let mut out = Vec::new();
        GcPause {
            start_ns: 1,
            dur_ns: 2,
            pid: 3,
            tid: 4,
            generation: 1,
            collected: 5,
        }
        .put(&mut out);
        out.pop(); // `collected` (one byte: zigzag(5) = 10)
        let g = GcPause::get(&mut Cur { b: &out, i: 0 }).unwrap();
        assert_eq!((g.generation, g.collected), (1, -1));
    }
}
