//! Where a recording goes: one file, or a directory of rotating segments (the agent). All
//! rotation state is here: the policy, the segment being written, when it started, the
//! counters last written, and the totals.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::Pipeline;
use crate::record::rotate::{next_segment_path, prune, RotationPolicy};
use crate::record::{EndInfo, Meta, RecordingWriter};
use crate::sys::monotonic_ns;

/// How often a recording writes its counters while it records (for a live reader's cost,
/// lost-sample and error counts; unchanged counters are not written again).
const LIVE_COUNTERS_EVERY: Duration = Duration::from_secs(5);

/// Counters written while a recording records: those that changed since the last write,
/// every [`LIVE_COUNTERS_EVERY`] (readers keep the last value of each counter).
#[derive(Debug)]
pub(crate) struct LiveCounters {
    written: BTreeMap<String, u64>,
    at: Instant,
}

impl LiveCounters {
    pub(crate) fn new() -> Self {
        LiveCounters {
            written: BTreeMap::new(),
            at: Instant::now(),
        }
    }

    /// Whether it is time to write them again.
    pub(crate) fn due(&self) -> bool {
        self.at.elapsed() >= LIVE_COUNTERS_EVERY
    }

    /// Write those of `c` that changed since the last write.
    pub(crate) fn write(
        &mut self,
        writer: &mut RecordingWriter,
        c: BTreeMap<String, u64>,
    ) -> anyhow::Result<()> {
        if c != self.written {
            let changed: BTreeMap<String, u64> = c
                .iter()
                .filter(|(k, v)| self.written.get(*k) != Some(v))
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            writer.counters(&changed)?;
            self.written = c;
        }
        self.at = Instant::now();
        Ok(())
    }

    /// A new segment has none written yet.
    fn forget(&mut self) {
        self.written.clear();
    }
}

/// Fail early, before attaching to anything, when `path` cannot be created: its directory is
/// missing or not writable.
pub(crate) fn check_writable(path: &Path) -> anyhow::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    anyhow::ensure!(
        dir.is_dir(),
        "cannot write the recording {}: directory {} does not exist (create it, or choose another -o)",
        path.display(),
        dir.display()
    );
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .context("a path with a NUL byte")?;
    // SAFETY: access() reads a valid NUL-terminated path.
    let rc = unsafe { libc::access(c.as_ptr(), libc::W_OK) };
    anyhow::ensure!(
        rc == 0,
        "cannot write the recording {}: directory {} is not writable ({})",
        path.display(),
        dir.display(),
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// Open the recording: `path`, or the first segment in the policy's directory.
pub fn open(
    path: &Path,
    rotation: Option<RotationPolicy>,
    meta: &Meta,
) -> anyhow::Result<(RecordingWriter, Option<Rotator>)> {
    let Some(policy) = rotation else {
        return Ok((RecordingWriter::create(path, meta)?, None));
    };
    let mut seq = 0;
    let first = next_segment_path(&policy.dir, meta.start_unix_s, &mut seq)
        .with_context(|| format!("naming a segment in {}", policy.dir.display()))?;
    let mut r = Rotator {
        policy,
        path: first,
        meta: meta.clone(),
        seq,
        started: Instant::now(),
        live: LiveCounters::new(),
        rotations: 0,
        segments_removed: 0,
    };
    r.prune()?;
    let w = RecordingWriter::create_rotating(&r.path, meta)?;
    Ok((w, Some(r)))
}

/// State of a rotating recording: the policy, the current segment and its start.
pub struct Rotator {
    pub policy: RotationPolicy,
    /// The segment being written.
    pub path: PathBuf,
    meta: Meta,
    seq: u64,
    started: Instant,
    live: LiveCounters,
    pub rotations: u64,
    pub segments_removed: u64,
}

impl Rotator {
    /// Work a rotating recording does between event batches (every 200 ms): end the segment
    /// when it is full or old enough (or rotation is asked for), else write the counters when
    /// they changed and a while has passed. `counters` gives the recording's counters now.
    pub(crate) fn periodic(
        &mut self,
        pipe: &mut Pipeline,
        counters: &dyn Fn(&Pipeline, &Rotator) -> BTreeMap<String, u64>,
    ) -> anyhow::Result<()> {
        let forced = self.policy.rotate_now.swap(false, Ordering::SeqCst);
        if forced
            || pipe.writer.bytes_written() >= self.policy.max_segment_bytes
            || self.started.elapsed() >= self.policy.max_segment_age
        {
            let c = counters(pipe, self);
            return self.rotate(pipe, &c);
        }
        if self.live.due() {
            let c = counters(pipe, self);
            self.live.write(&mut pipe.writer, c)?;
        }
        Ok(())
    }

    /// End the current segment and start the next, which reads on its own: intervals still
    /// open (off CPU, GIL waits) are split at the rotation, their part so far written into the
    /// ending segment; threads and processes that exited are forgotten; old segments beyond
    /// the caps are removed.
    fn rotate(
        &mut self,
        pipe: &mut Pipeline,
        counters: &BTreeMap<String, u64>,
    ) -> anyhow::Result<()> {
        let now = monotonic_ns();
        let thread_alive =
            |pid: i32, tid: i32| Path::new(&format!("/proc/{pid}/task/{tid}")).exists();
        pipe.split_open(now, &thread_alive, &crate::procinfo::is_running)?;
        pipe.writer.counters(counters)?;
        let m = &self.meta;
        let unix_now = m.start_unix_s + now.saturating_sub(m.start_mono_ns) as f64 / 1e9;
        let path = next_segment_path(&self.policy.dir, unix_now, &mut self.seq)
            .with_context(|| format!("naming a segment in {}", self.policy.dir.display()))?;
        let meta = Meta {
            start_mono_ns: now,
            start_unix_s: unix_now,
            ..self.meta.clone()
        };
        let carry = pipe.writer.rotate(
            &path,
            &meta,
            &EndInfo {
                duration_ns: pipe.rel(now),
                reason: "rotated".into(),
            },
            &|pid, tid| match tid {
                None => crate::procinfo::is_running(pid),
                Some(tid) => thread_alive(pid, tid),
            },
        )?;
        pipe.carry_open(now, &carry)?;
        pipe.writer.flush()?;
        self.path = path;
        self.started = Instant::now();
        self.live.forget();
        self.rotations += 1;
        self.prune()
    }

    /// Remove the oldest segments beyond the caps (leaving room for the one being written).
    fn prune(&mut self) -> anyhow::Result<()> {
        let p = &self.policy;
        let cap = p.max_total_bytes.saturating_sub(p.max_segment_bytes);
        let removed = prune(&p.dir, &self.path, cap, p.max_segments)
            .with_context(|| format!("removing old segments in {}", p.dir.display()))?;
        self.segments_removed += removed.len() as u64;
        Ok(())
    }

    pub fn counters(&self, out: &mut BTreeMap<String, u64>) {
        out.insert("segments_rotated".into(), self.rotations);
        out.insert("segments_removed".into(), self.segments_removed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::abi;
    use crate::record::{Frame, ProcessInfo};

    fn frame(f: &str) -> Frame {
        Frame {
            function: f.into(),
            file: "x.py".into(),
            line: Some(1),
        }
    }

    #[test]
    fn rotation_splits_open_intervals_and_forgets_exited_threads() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id() as i32;
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let dead = (me, i32::MAX - 7); // no such thread
        let t0 = monotonic_ns() - 1_000_000_000;
        let meta = Meta {
            start_mono_ns: t0,
            start_unix_s: 1_700_000_000.0,
            ..Default::default()
        };
        let mut seq = 0;
        let first = crate::record::rotate::next_segment_path(dir.path(), 1.0, &mut seq).unwrap();
        let policy = RotationPolicy::new(dir.path().to_path_buf());
        let rotate_now = policy.rotate_now.clone();
        let mut pipe = Pipeline::new(
            RecordingWriter::create_rotating(&first, &meta).unwrap(),
            t0,
            100,
        );
        let mut rotator = Rotator {
            policy,
            path: first.clone(),
            meta: meta.clone(),
            seq,
            started: Instant::now(),
            live: LiveCounters::new(),
            rotations: 0,
            segments_removed: 0,
        };
        pipe.writer
            .process(&ProcessInfo {
                pid: me,
                ..Default::default()
            })
            .unwrap();
        // Stacks the new segment will not carry, so that carried ids differ from the old ones.
        for f in ["x1", "x2"] {
            pipe.writer.intern_stack(&[frame(f)]).unwrap();
        }
        let blocked = pipe
            .writer
            .intern_stack(&[frame("wait"), frame("main")])
            .unwrap();
        let holder = pipe.writer.intern_stack(&[frame("hold")]).unwrap();
        let ms = 1_000_000;
        let running = pipe.writer.intern_stack(&[frame("spin")]).unwrap();
        pipe.sample(me, tid, t0 + 50 * ms, running, 0, 10 * ms)
            .unwrap();
        pipe.switch_out(me, tid, t0 + 100 * ms, blocked, false)
            .unwrap();
        pipe.switch_out(dead.0, dead.1, t0 + 150 * ms, blocked, false)
            .unwrap();
        pipe.gil_wait_start(me, tid, t0 + 200 * ms, 1, holder, false);
        let stats0 = abi::GcStats::default();
        pipe.gc_edge(me, tid, t0 + 300 * ms, 1, stats0).unwrap();

        rotate_now.store(true, Ordering::SeqCst);
        rotator
            .periodic(&mut pipe, &|_, _| {
                BTreeMap::from([("bpf_ringbuf_full_lost".to_string(), 3)])
            })
            .unwrap();
        let rot = pipe.start_ns;
        assert!(rot > t0 + 300 * ms);
        let second = rotator.path.clone();
        assert_ne!(second, first);

        // The thread's last known stack (for yields recorded without a walk)
        // names the same frames in the new segment.
        pipe.switch_in(me, tid, rot + 5 * ms).unwrap();
        let last = pipe.last_stack(me, tid);
        pipe.switch_out(me, tid, rot + 10 * ms, last, true).unwrap();
        pipe.switch_in(me, tid, rot + 20 * ms).unwrap();
        pipe.switch_out(me, tid, rot + 20 * ms, last, false)
            .unwrap();
        let end = rot + 50 * ms;
        let stats1 = abi::GcStats {
            collections: [1, 1, 0],
            collected: [5, 9, 0],
            ..Default::default()
        };
        pipe.gc_edge(me, tid, end, 0, stats1).unwrap();
        pipe.gil_wait_end(me, tid, end).unwrap();
        pipe.switch_in(me, tid, end).unwrap();
        pipe.close(end).unwrap();
        let Pipeline { writer, .. } = pipe;
        writer
            .finish(&EndInfo {
                duration_ns: 50 * ms,
                reason: "done".into(),
            })
            .unwrap();

        let r1 = crate::record::read_recording(&first).unwrap();
        let split = (rot - t0) - 100 * ms;
        assert_eq!(r1.end.as_ref().unwrap().reason, "rotated");
        assert_eq!(r1.end.as_ref().unwrap().duration_ns, rot - t0);
        assert_eq!(r1.counters.get("bpf_ringbuf_full_lost"), Some(&3));
        // The exited thread's pending switch-out is not a wait: nothing for it.
        assert_eq!(r1.offcpu.len(), 1, "{:?}", r1.offcpu);
        assert_eq!((r1.offcpu[0].tid, r1.offcpu[0].start_ns), (tid, 100 * ms));
        assert_eq!(r1.offcpu[0].dur_ns, split);
        assert_eq!(r1.gil_waits.len(), 1);
        assert_eq!(r1.gil_waits[0].dur_ns, (rot - t0) - 200 * ms);
        assert!(r1.gc_pauses.is_empty());

        let r2 = crate::record::read_recording(&second).unwrap();
        assert_eq!(r2.meta.start_mono_ns, rot);
        assert!((r2.meta.start_unix_s - (1_700_000_000.0 + (rot - t0) as f64 / 1e9)).abs() < 1e-6);
        assert_eq!(r2.offcpu.len(), 3, "{:?}", r2.offcpu);
        assert_eq!((r2.offcpu[0].start_ns, r2.offcpu[0].dur_ns), (0, 5 * ms));
        let names =
            |s: u32| -> Vec<&str> { r2.stack_frames(s).map(|f| f.function.as_str()).collect() };
        assert_eq!(
            names(r2.offcpu[0].stack),
            ["wait", "main"],
            "the blocked stack carried over"
        );
        assert_eq!(
            names(r2.offcpu[1].stack),
            ["wait", "main"],
            "last known stack carried"
        );
        assert_eq!(
            (r2.offcpu[1].start_ns, r2.offcpu[1].dur_ns),
            (10 * ms, 10 * ms)
        );
        assert_eq!(
            (r2.offcpu[2].start_ns, r2.offcpu[2].dur_ns),
            (20 * ms, 30 * ms)
        );
        assert_eq!(r2.gil_waits.len(), 1);
        assert_eq!(
            (r2.gil_waits[0].start_ns, r2.gil_waits[0].dur_ns),
            (0, 50 * ms)
        );
        let names: Vec<&str> = r2
            .stack_frames(r2.gil_waits[0].holder_stack)
            .map(|f| f.function.as_str())
            .collect();
        assert_eq!(names, ["hold"]);
        // The GC pause is written whole where it ends.
        assert_eq!(r2.gc_pauses.len(), 1);
        let g = r2.gc_pauses[0];
        assert_eq!((g.start_ns, g.generation, g.collected), (0, 1, 9));
        assert_eq!(g.dur_ns, end - (t0 + 300 * ms));
        assert_eq!(r2.processes.len(), 1);
    }
}
