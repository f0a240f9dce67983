//! The `.esrec` file format, version 1 (docs/recording-format.md).
//!
//! `ESREC\0` + u16 version, then records `[tag: u8][len: varint][payload]`. Payloads are JSON
//! for rare records (meta, processes, threads, counters, end) and LEB128 varints for the
//! frequent ones (frames, stacks, samples, off-CPU intervals). Records are only ever appended
//! and the writer flushes whole records, so a recorder killed at any moment leaves a file that
//! reads cleanly up to its last flush.
//!
//! Each binary record's fields are laid out once, encoder beside decoder, in [`layout`]; the
//! writer ([`RecordingWriter`]: interning, aggregation, rotation, the disk reserve) and the
//! reader ([`RecordingReader`]: a dispatch on the tag) live in files of their own.

use anyhow::{bail, Context};
use std::collections::HashMap;

use crate::record::model::{RunningTask, TaskChange};

mod layout;
mod reader;
mod writer;

pub use reader::{parse_recording, read_recording, RecordingReader};
pub use writer::{DiskFull, RecordingWriter, StackCarry, RESERVE, RESERVE_TAIL};

pub(crate) const MAGIC: &[u8; 6] = b"ESREC\0";
pub(crate) const VERSION: u16 = 1;

mod tag {
    pub(crate) const META: u8 = 1;
    pub(crate) const PROCESS: u8 = 2;
    pub const THREAD: u8 = 3;
    pub(crate) const FRAME: u8 = 4;
    pub(crate) const STACK: u8 = 5;
    pub(crate) const SAMPLE: u8 = 6;
    pub const OFFCPU: u8 = 7;
    pub(crate) const COUNTERS: u8 = 8;
    pub(crate) const END: u8 = 9;
    pub(crate) const GIL_WAIT: u8 = 10;
    pub(crate) const GC_PAUSE: u8 = 11;
    pub(crate) const ENGINE: u8 = 12;
    pub(crate) const SERIES: u8 = 13;
    pub(crate) const METRIC: u8 = 14;
    pub(crate) const SCRAPE_ERROR: u8 = 15;
    pub(crate) const PROBE: u8 = 16;
    pub(crate) const CALL: u8 = 17;
    pub(crate) const TASK: u8 = 18;
    pub(crate) const GC_METHOD: u8 = 19;
    pub(crate) const PROBE_WATCH: u8 = 20;
    /// Aggregated events (`record::profile`): an interval, then what it added up.
    pub(crate) const INTERVAL: u8 = 21;
    pub(crate) const SAMPLES: u8 = 22;
    pub(crate) const OFFCPU_SUM: u8 = 23;
    pub(crate) const GIL_WAIT_SUM: u8 = 24;
    pub(crate) const CALL_HIST: u8 = 25;
    pub(crate) const WAKE: u8 = 26;
    pub(crate) const GC_HIST: u8 = 27;
    /// An event-loop thread's long off-CPU intervals between two of its samples, merged.
    pub(crate) const OFFCPU_RUN: u8 = 28;
}

/// Record 18 as written: a task's await chain (tens of qualified names; an API server's loop
/// changes task a few times a second, mostly among a few chains) in full the first time it
/// occurs in a file, with an id, then by that id alone with an empty `chain` (older readers
/// read such a task without its chain).
#[derive(serde::Serialize, serde::Deserialize)]
struct TaskWire {
    t_ns: u64,
    pid: i32,
    tid: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    task: Option<TaskWireTask>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prev_seen_ns: Option<u64>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct TaskWireTask {
    name: String,
    coro: String,
    #[serde(default)]
    chain: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    chain_id: Option<u32>,
}

impl TaskWire {
    /// `t` as written, its chain interned in `chains` (the file's so far).
    fn of(t: &TaskChange, chains: &mut crate::sys::FastMap<Vec<String>, u32>) -> TaskWire {
        let task = t.task.as_ref().map(|k| {
            let (chain, chain_id) = if k.chain.is_empty() {
                (Vec::new(), None)
            } else if let Some(&id) = chains.get(&k.chain) {
                (Vec::new(), Some(id))
            } else {
                let id = chains.len() as u32;
                chains.insert(k.chain.clone(), id);
                (k.chain.clone(), Some(id))
            };
            TaskWireTask {
                name: k.name.clone(),
                coro: k.coro.clone(),
                chain,
                chain_id,
            }
        });
        TaskWire {
            t_ns: t.t_ns,
            pid: t.pid,
            tid: t.tid,
            task,
            prev_seen_ns: t.prev_seen_ns,
        }
    }

    /// The task change, its chain looked up in `chains` (the file's so far) where it is given
    /// by id; an id never defined reads as no chain.
    fn resolve(self, chains: &mut HashMap<u32, Vec<String>>) -> TaskChange {
        let task = self.task.map(|k| {
            let chain = match k.chain_id {
                Some(id) if k.chain.is_empty() => chains.get(&id).cloned().unwrap_or_default(),
                Some(id) => {
                    chains.insert(id, k.chain.clone());
                    k.chain
                }
                None => k.chain,
            };
            RunningTask {
                name: k.name,
                coro: k.coro,
                chain,
            }
        });
        TaskChange {
            t_ns: self.t_ns,
            pid: self.pid,
            tid: self.tid,
            task,
            prev_seen_ns: self.prev_seen_ns,
        }
    }
}

/// The most events one aggregated record may stand for (a reader expands them): far above
/// what one thread does in an interval, a bound against a corrupt count.
const MAX_AGGREGATED_COUNT: u64 = 1 << 24;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

struct Cur<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cur<'_> {
    fn varint(&mut self) -> anyhow::Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&b) = self.b.get(self.i) else {
                bail!("truncated varint")
            };
            self.i += 1;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!("varint too long")
    }
    fn u8(&mut self) -> anyhow::Result<u8> {
        let Some(&b) = self.b.get(self.i) else {
            bail!("truncated")
        };
        self.i += 1;
        Ok(b)
    }
    fn str(&mut self) -> anyhow::Result<String> {
        let n = self.varint()? as usize;
        let end = self
            .i
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .context("truncated string")?;
        let s = String::from_utf8_lossy(&self.b[self.i..end]).into_owned();
        self.i = end;
        Ok(s)
    }
    fn i32(&mut self) -> anyhow::Result<i32> {
        i32::try_from(unzigzag(self.varint()?)).context("id out of range")
    }
}

/// The count of an aggregated record, bounded ([`MAX_AGGREGATED_COUNT`]).
fn aggregated_count(n: u64) -> anyhow::Result<u64> {
    anyhow::ensure!(
        n <= MAX_AGGREGATED_COUNT,
        "an aggregated record of {n} events (corrupt?)"
    );
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::model::*;
    use crate::record::profile::{self, AggregateOptions};
    use std::path::Path;

    fn frame(f: &str, line: i32) -> Frame {
        Frame {
            function: f.into(),
            file: "x.py".into(),
            line: Some(line),
        }
    }

    #[test]
    fn native_frames_roundtrip_and_older_frame_records_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.esrec");
        let mut w = RecordingWriter::create(&path, &Meta::default()).unwrap();
        let native = Frame {
            function: "save_list".into(),
            file: "/x/_pickle.so".into(),
            line: None,
        };
        let info = NativeFrameInfo {
            kind: FRAME_NATIVE,
            addr: 0x1234,
            module: "/x/_pickle.so".into(),
            build_id: "abcd".into(),
        };
        let s = w
            .intern_mixed(&[
                (native.clone(), Some(info.clone())),
                (frame("main", 3), None),
            ])
            .unwrap();
        w.finish(&EndInfo::default()).unwrap();
        let r = read_recording(&path).unwrap();
        let ids = &r.stacks[s as usize];
        assert_eq!(r.frames[ids[0] as usize], native);
        assert_eq!(r.frame_native.get(&ids[0]), Some(&info));
        assert_eq!(r.frame_kind(ids[1]), 0);
        // A frame record as the first writers wrote it (no trailing fields) is a Python frame.
        let mut rd = RecordingReader::default();
        let mut file = Vec::new();
        file.extend_from_slice(MAGIC);
        file.extend_from_slice(&VERSION.to_le_bytes());
        let mut meta = serde_json::to_vec(&Meta::default()).unwrap();
        file.push(tag::META);
        put_varint(&mut file, meta.len() as u64);
        file.append(&mut meta);
        let mut p = Vec::new();
        put_varint(&mut p, 0);
        put_varint(&mut p, 0);
        put_str(&mut p, "f");
        put_str(&mut p, "a.py");
        file.push(tag::FRAME);
        put_varint(&mut file, p.len() as u64);
        file.extend_from_slice(&p);
        rd.feed(&file).unwrap();
        assert_eq!(rd.recording.frames.len(), 1);
        assert!(rd.recording.frame_native.is_empty());
    }

    /// Record 18: task changes read back in order; a rotation carries the tasks in progress
    /// (not the threads that ran none) into the new segment at time 0. Await chains are
    /// written whole once per file, then by id, and read back whole in every file; a reader
    /// that knows no ids (older ones) reads the repeats without their chain.
    #[test]
    fn task_changes_roundtrip_and_rotate() {
        use crate::record::RunningTask;
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.esrec"), dir.path().join("b.esrec"));
        let meta = Meta::default();
        let mut w = RecordingWriter::create_rotating(&a, &meta).unwrap();
        w.process(&ProcessInfo {
            pid: 7,
            ..Default::default()
        })
        .unwrap();
        for tid in [7, 8] {
            w.thread(&ThreadInfo {
                pid: 7,
                tid,
                ..Default::default()
            })
            .unwrap();
        }
        let task = RunningTask {
            name: "handler-1".into(),
            coro: "handle_request".into(),
            chain: vec!["handle_request".into(), "render_response".into()],
        };
        let changes = [
            TaskChange {
                t_ns: 10,
                pid: 7,
                tid: 7,
                task: Some(task.clone()),
                prev_seen_ns: None,
            },
            TaskChange {
                t_ns: 20,
                pid: 7,
                tid: 8,
                task: Some(task.clone()),
                prev_seen_ns: None,
            },
            TaskChange {
                t_ns: 30,
                pid: 7,
                tid: 8,
                task: None,
                prev_seen_ns: Some(15),
            },
            TaskChange {
                t_ns: 40,
                pid: 7,
                tid: 8,
                task: Some(RunningTask {
                    chain: vec!["other".into()],
                    ..task.clone()
                }),
                prev_seen_ns: None,
            },
        ];
        for c in &changes {
            w.task_change(c).unwrap();
        }
        w.flush().unwrap();
        assert_eq!(read_recording(&a).unwrap().task_changes, changes);
        // The chain twice in the file's changes, once in its bytes.
        let bytes = std::fs::read(&a).unwrap();
        let needle = b"render_response";
        assert_eq!(
            bytes.windows(needle.len()).filter(|w| w == needle).count(),
            1
        );
        // What an older reader makes of the repeat: the task without its chain.
        let mut chains = crate::sys::FastMap::default();
        chains.insert(task.chain.clone(), 0u32);
        let wire = serde_json::to_vec(&TaskWire::of(&changes[1], &mut chains)).unwrap();
        let old: TaskChange = serde_json::from_slice(&wire).unwrap();
        assert_eq!(old.task.map(|t| t.chain), Some(Vec::new()));
        w.rotate(&b, &meta, &EndInfo::default(), &|_, _| true)
            .unwrap();
        // The new file has its own table: a repeat of a chain the old one defined.
        w.task_change(&changes[1]).unwrap();
        w.finish(&EndInfo::default()).unwrap();
        let carried: Vec<TaskChange> = [0, 3]
            .iter()
            .map(|&i| TaskChange {
                t_ns: 0,
                ..changes[i].clone()
            })
            .chain([changes[1].clone()])
            .collect();
        assert_eq!(read_recording(&b).unwrap().task_changes, carried);
    }

    #[test]
    fn roundtrip_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.esrec");
        let meta = Meta {
            rate_hz: 1000,
            backend: "bpf".into(),
            ..Default::default()
        };
        let mut w = RecordingWriter::create(&path, &meta).unwrap();
        w.process(&ProcessInfo {
            pid: 7,
            ..Default::default()
        })
        .unwrap();
        w.thread(&ThreadInfo {
            pid: 7,
            tid: 8,
            name: "main".into(),
            t_ns: 0,
            python_name: None,
        })
        .unwrap();
        let s1 = w
            .intern_stack(&[frame("leaf", 3), frame("main", 10)])
            .unwrap();
        let s2 = w
            .intern_stack(&[frame("leaf", 3), frame("main", 10)])
            .unwrap();
        assert_eq!(s1, s2);
        let s3 = w
            .intern_stack(&[Frame {
                function: "n".into(),
                file: "f".into(),
                line: None,
            }])
            .unwrap();
        for i in 0..100u64 {
            w.sample(&Sample {
                t_ns: i * 1_000_000,
                pid: 7,
                tid: 8,
                stack: s1,
                flags: flags::GIL,
                weight_ns: 1_000_000,
            })
            .unwrap();
        }
        w.offcpu(&OffCpu {
            pid: 7,
            tid: 8,
            start_ns: 5,
            dur_ns: 10,
            stack: s3,
            preempted: false,
            stolen: false,
        })
        .unwrap();
        let gw = GilWait {
            pid: 7,
            tid: 8,
            start_ns: 100,
            dur_ns: 5_000_000,
            holder_tid: 9,
            holder_stack: s1,
            waiter_stack: s3,
            switch_wait: false,
        };
        w.gil_wait(&gw).unwrap();
        let gp = GcPause {
            pid: 7,
            tid: 9,
            start_ns: 200,
            dur_ns: 1_500_000,
            generation: 2,
            collected: 1234,
        };
        w.gc_pause(&gp).unwrap();
        let eng = EngineInfo {
            id: "engine0".into(),
            api_server_pid: 7,
            api_server_pids: vec![7, 11],
            engine_core_pids: vec![8],
            worker_pids: vec![9, 10],
            metrics_url: "http://127.0.0.1:8000/metrics".into(),
            metrics_url_source: "argv".into(),
            t_ns: 3,
        };
        w.engine(&eng).unwrap();
        let ser = MetricSeries {
            id: 0,
            engine: "engine0".into(),
            name: "vllm:kv_cache_usage_perc".into(),
            labels: [("model_name".to_string(), "m".to_string())].into(),
            kind: "gauge".into(),
        };
        w.series(&ser).unwrap();
        let mp = MetricPoint {
            t_ns: 1_000,
            series: 0,
            value: 0.25,
        };
        w.metric(&mp).unwrap();
        let pr = ProbeInfo {
            id: 0,
            spec: "MessageQueue.enqueue".into(),
            pid: 7,
            function: "MessageQueue.enqueue".into(),
            file: "shm.py".into(),
            firstlineno: 12,
            method: "exact".into(),
            resolution_ns: 30_000,
            t_ns: 4,
        };
        w.probe(&pr).unwrap();
        let call = FunctionCall {
            probe: 0,
            pid: 7,
            tid: 8,
            start_ns: 10,
            dur_ns: 940_000,
        };
        w.call(&call).unwrap();
        let per_sample = {
            let before = w.bytes_written();
            w.sample(&Sample {
                t_ns: 123_456_789,
                pid: 7,
                tid: 8,
                stack: s1,
                flags: 0,
                weight_ns: 1_000_000,
            })
            .unwrap();
            w.bytes_written() - before
        };
        assert!(per_sample <= 16, "{per_sample} bytes per sample");
        w.finish(&EndInfo {
            duration_ns: 5,
            reason: "done".into(),
        })
        .unwrap();

        let r = read_recording(&path).unwrap();
        assert!(!r.truncated);
        assert_eq!(r.meta, meta);
        assert_eq!(r.samples.len(), 101);
        assert_eq!(
            r.stack_frames(s1)
                .map(|f| f.function.as_str())
                .collect::<Vec<_>>(),
            ["leaf", "main"]
        );
        assert_eq!(r.stack_frames(s3).next().unwrap().line, None);
        assert_eq!(r.offcpu.len(), 1);
        assert_eq!(r.gil_waits, vec![gw]);
        assert_eq!(r.gc_pauses, vec![gp]);
        assert_eq!(r.engines, vec![eng]);
        assert_eq!(r.series, vec![ser]);
        assert_eq!(r.metrics, vec![mp]);
        assert_eq!(r.probes, vec![pr]);
        assert_eq!(r.calls, vec![call]);
        assert_eq!(r.thread_name(7, 8), "main");
        assert!(r.end.is_some());

        reads_cut_or_in_pieces(&path, &r);
    }

    /// A recording's file cut anywhere still reads, up to its last whole record; fed in pieces
    /// of any size, the incremental reader ends with the same recording as `r`.
    fn reads_cut_or_in_pieces(path: &Path, r: &Recording) {
        // Cut the file anywhere: it still reads, up to the last whole record.
        let bytes = std::fs::read(path).unwrap();
        for cut in [bytes.len() - 1, bytes.len() - 30, bytes.len() / 2] {
            let r = parse_recording(&bytes[..cut]).unwrap();
            assert!(r.truncated || r.end.is_none());
            assert!(r.end.is_none());
        }
        // Fed in pieces of any size, the incremental reader ends with the same recording.
        for chunk in [1, 7, 64, 4096] {
            let mut rd = RecordingReader::default();
            for piece in bytes.chunks(chunk) {
                rd.feed(piece).unwrap();
            }
            assert_eq!(rd.recording.samples, r.samples);
            assert_eq!(rd.recording.calls, r.calls);
            assert!(rd.recording.end.is_some());
        }
        assert!(parse_recording(b"nope").is_err());
        assert!(
            parse_recording(&bytes[..20]).is_err(),
            "cut inside the header record"
        );
    }

    fn ser(id: u32, engine: &str, name: &str) -> MetricSeries {
        MetricSeries {
            id,
            engine: engine.into(),
            name: name.into(),
            ..Default::default()
        }
    }

    fn point(series: u32, value: f64) -> MetricPoint {
        MetricPoint {
            t_ns: 5,
            series,
            value,
        }
    }

    /// The first segment of the rotation test: processes 7 and 8 (8 gone by the rotation),
    /// a renamed thread and one that exits, three engines, a series and a probe of each engine.
    fn write_first_segment(w: &mut RecordingWriter) {
        for pid in [7, 8] {
            w.process(&ProcessInfo {
                pid,
                role: format!("r{pid}"),
                ..Default::default()
            })
            .unwrap();
        }
        for (pid, tid, name) in [
            (7, 70, "old"),
            (7, 70, "renamed"),
            (7, 71, "gone"),
            (8, 80, "x"),
        ] {
            w.thread(&ThreadInfo {
                pid,
                tid,
                name: name.into(),
                t_ns: 5,
                python_name: None,
            })
            .unwrap();
        }
        for (id, pids) in [("e0", vec![7]), ("e1", vec![8]), ("remote", vec![])] {
            w.engine(&EngineInfo {
                id: id.into(),
                engine_core_pids: pids,
                t_ns: 9,
                ..Default::default()
            })
            .unwrap();
        }
        // Series under the scraper's ids: engine e1 (process 8) will be gone at the rotation.
        w.series(&ser(0, "e1", "vllm:gone")).unwrap();
        w.series(&ser(1, "e0", "vllm:x")).unwrap();
        w.metric(&point(1, 1.0)).unwrap();
        // Probes under the sampler's ids; process 8's will be gone at the rotation.
        for (id, pid) in [(0, 8), (1, 7)] {
            w.probe(&ProbeInfo {
                id,
                pid,
                function: format!("f{pid}"),
                t_ns: 3,
                ..Default::default()
            })
            .unwrap();
        }
    }

    #[test]
    fn rotation_makes_standalone_segments() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.esrec"), dir.path().join("b.esrec"));
        let meta = Meta {
            rate_hz: 99,
            ..Default::default()
        };
        let mut w = RecordingWriter::create_rotating(&a, &meta).unwrap();
        write_first_segment(&mut w);
        let deep = w
            .intern_stack(&[frame("leaf", 1), frame("mid", 2), frame("main", 3)])
            .unwrap();
        let other = w.intern_stack(&[frame("other", 9)]).unwrap();
        w.sample(&Sample {
            t_ns: 1_000,
            pid: 7,
            tid: 70,
            stack: other,
            flags: 0,
            weight_ns: 10,
        })
        .unwrap();
        // Process 8 and thread 71 have exited by the rotation.
        let alive = |pid: i32, tid: Option<i32>| pid == 7 && tid != Some(71);
        let meta2 = Meta {
            start_mono_ns: 5_000,
            ..meta.clone()
        };
        let carry = w
            .rotate(
                &b,
                &meta2,
                &EndInfo {
                    duration_ns: 2_000,
                    reason: "rotated".into(),
                },
                &alive,
            )
            .unwrap();
        let deep2 = carry.carry(&mut w, deep).unwrap();
        assert_eq!(
            carry.carry(&mut w, 999).unwrap(),
            0,
            "unknown id: empty stack"
        );
        w.sample(&Sample {
            t_ns: 10,
            pid: 7,
            tid: 70,
            stack: deep2,
            flags: 0,
            weight_ns: 10,
        })
        .unwrap();
        for probe in [1, 0] {
            // Probe 0 (process 8's) is gone with its process: its call is dropped.
            w.call(&FunctionCall {
                probe,
                pid: 7,
                tid: 70,
                start_ns: 0,
                dur_ns: 5,
            })
            .unwrap();
        }
        w.metric(&point(1, 2.0)).unwrap();
        w.metric(&point(0, 9.0)).unwrap(); // e1's: dropped with its engine
        w.series(&ser(2, "e0", "vllm:y")).unwrap();
        w.metric(&point(2, 3.0)).unwrap();
        w.finish(&EndInfo {
            duration_ns: 20,
            reason: "done".into(),
        })
        .unwrap();

        let r1 = read_recording(&a).unwrap();
        assert_eq!(r1.end.as_ref().unwrap().reason, "rotated");
        assert_eq!(r1.samples.len(), 1);
        assert_eq!(r1.stacks.len(), 3);
        let r2 = read_recording(&b).unwrap();
        assert_eq!(r2.meta, meta2);
        assert_eq!(r2.processes.len(), 1);
        assert_eq!(r2.processes[0].role, "r7");
        assert_eq!(r2.threads.len(), 1, "{:?}", r2.threads);
        assert_eq!(r2.threads[0].name, "renamed");
        assert_eq!(r2.threads[0].t_ns, 0);
        let ids: Vec<&str> = r2.engines.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["e0", "remote"]);
        // The first segment had both series under dense ids; the second only e0's,
        // numbered afresh, with the points translated.
        let names = |r: &Recording| -> Vec<(u32, String)> {
            r.series.iter().map(|s| (s.id, s.name.clone())).collect()
        };
        assert_eq!(
            names(&r1),
            [(0, "vllm:gone".to_string()), (1, "vllm:x".to_string())]
        );
        assert_eq!(r1.metrics, vec![point(1, 1.0)]);
        assert_eq!(
            names(&r2),
            [(0, "vllm:x".to_string()), (1, "vllm:y".to_string())]
        );
        assert_eq!(r2.metrics, vec![point(0, 2.0), point(1, 3.0)]);
        assert_eq!(r1.probes.len(), 2);
        assert_eq!(r2.probes.len(), 1);
        assert_eq!((r2.probes[0].id, r2.probes[0].function.as_str()), (0, "f7"));
        assert_eq!(r2.calls.len(), 1);
        assert_eq!(
            r2.calls[0].probe, 0,
            "call translated to the segment's probe id"
        );
        // Only the stack carried is in the new table, under a new id, with the same frames.
        assert_eq!(r2.stacks.len(), 2);
        let names: Vec<&str> = r2
            .stack_frames(r2.samples[0].stack)
            .map(|f| f.function.as_str())
            .collect();
        assert_eq!(names, ["leaf", "mid", "main"]);
        assert_eq!(
            r2.samples[0].t_ns, 10,
            "sample times restart with the segment"
        );
        assert!(r2.end.is_some());
    }

    #[test]
    fn only_a_rotating_writer_rotates() {
        let dir = tempfile::tempdir().unwrap();
        let meta = Meta::default();
        let alive = |_: i32, _: Option<i32>| true;
        let mut plain = RecordingWriter::create(&dir.path().join("c.esrec"), &meta).unwrap();
        assert!(plain
            .rotate(
                &dir.path().join("d.esrec"),
                &meta,
                &EndInfo::default(),
                &alive
            )
            .is_err());
    }

    #[test]
    fn garbage_never_panics() {
        let mut seed = 42u64;
        let mut base = MAGIC.to_vec();
        base.extend_from_slice(&VERSION.to_le_bytes());
        for n in 0..200 {
            let mut d = base.clone();
            for _ in 0..n {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                d.push(seed as u8);
            }
            let _ = parse_recording(&d);
        }
    }

    fn agg_opts(interval_ns: u64) -> AggregateOptions {
        AggregateOptions {
            interval_ns,
            event_loop_role: "api_server",
            keep_series: |n| n.starts_with("vllm:kept"),
        }
    }

    /// The events of `aggregated_events_read_back_with_exact_sums_and_counts`, raw or aggregated
    /// in 100 ms intervals; the file's size in bytes.
    fn write_mixed_events(path: &Path, agg: bool) -> u64 {
        let meta = Meta::default();
        let ms = 1_000_000u64;
        let mut w = RecordingWriter::create(path, &meta).unwrap();
        if agg {
            w.aggregate(agg_opts(100 * ms));
        }
        w.process(&ProcessInfo {
            pid: 7,
            role: "api_server".into(),
            ..Default::default()
        })
        .unwrap();
        w.process(&ProcessInfo {
            pid: 8,
            role: "engine_core".into(),
            ..Default::default()
        })
        .unwrap();
        w.probe(&ProbeInfo {
            id: 0,
            pid: 8,
            function: "step".into(),
            ..Default::default()
        })
        .unwrap();
        w.task_change(&TaskChange {
            t_ns: 0,
            pid: 8,
            tid: 11,
            task: Some(crate::record::RunningTask {
                name: "t".into(),
                coro: "c".into(),
                chain: vec![],
            }),
            prev_seen_ns: None,
        })
        .unwrap();
        let a = w.intern_stack(&[frame("a", 1)]).unwrap();
        let b = w.intern_stack(&[frame("b", 2), frame("a", 1)]).unwrap();
        let mut seed = 7u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for i in 0..2000u64 {
            let t = i * ms / 2;
            w.profile_tick(t).unwrap();
            let (pid, tid) = [(7, 7), (7, 12), (8, 8), (8, 9), (8, 11)][(i % 5) as usize];
            let stack = if rnd() % 3 == 0 { a } else { b };
            w.sample(&Sample {
                t_ns: t,
                pid,
                tid,
                stack,
                flags: (rnd() % 2) as u8,
                weight_ns: 10_000_000 + (rnd() % 1000) as u32,
            })
            .unwrap();
            // Now and then a long block (an event loop's idle wait) of (7, 7) and (8, 11).
            let long = i % 50 == 0 || i % 50 == 4;
            w.offcpu(&OffCpu {
                pid,
                tid,
                start_ns: t,
                dur_ns: if long { 5 * ms } else { rnd() % 300_000 },
                stack,
                preempted: rnd() % 4 == 0,
                stolen: false,
            })
            .unwrap();
            w.gil_wait(&GilWait {
                pid,
                tid,
                start_ns: t,
                dur_ns: rnd() % 100_000,
                holder_tid: 9,
                holder_stack: a,
                waiter_stack: stack,
                switch_wait: false,
            })
            .unwrap();
            w.call(&FunctionCall {
                start_ns: t,
                dur_ns: 1000 + rnd() % 50_000_000,
                pid,
                tid,
                probe: 0,
            })
            .unwrap();
        }
        w.finish(&EndInfo {
            duration_ns: 1000 * ms,
            reason: "done".into(),
        })
        .unwrap()
    }

    /// An event loop's long off-CPU intervals between two of its samples: the first and the
    /// last as they were, those between merged by stack into back-to-back runs (record 28),
    /// read back with their count and their sum per stack; a change of stack ends a run.
    #[test]
    fn an_event_loops_blocks_between_samples_are_merged_but_their_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loop.esrec");
        let ms = 1_000_000u64;
        let mut w = RecordingWriter::create(&path, &Meta::default()).unwrap();
        w.aggregate(agg_opts(10_000 * ms));
        w.process(&ProcessInfo {
            pid: 7,
            role: "api_server".into(),
            ..Default::default()
        })
        .unwrap();
        let poll = w.intern_stack(&[frame("select", 1)]).unwrap();
        let lock = w.intern_stack(&[frame("acquire", 2)]).unwrap();
        let sample = |t_ns| Sample {
            t_ns,
            pid: 7,
            tid: 7,
            stack: poll,
            flags: 0,
            weight_ns: 1_000_000,
        };
        let off = |start_ms: u64, dur_ms: u64, stack| OffCpu {
            start_ns: start_ms * ms,
            dur_ns: dur_ms * ms,
            pid: 7,
            tid: 7,
            stack,
            preempted: false,
            stolen: false,
        };
        // Between the samples at 0 and 100 ms: seven blocks, the fifth in a lock; one short
        // block (summed as before); then one block after the last sample.
        let blocks = [
            off(10, 3, poll),
            off(20, 4, poll),
            off(30, 5, poll),
            off(40, 6, poll),
            off(50, 7, lock),
            off(60, 8, poll),
            off(70, 9, poll),
        ];
        w.sample(&sample(0)).unwrap();
        for o in &blocks {
            w.offcpu(o).unwrap();
        }
        w.offcpu(&off(80, 1, poll)).unwrap();
        w.sample(&sample(100 * ms)).unwrap();
        w.offcpu(&off(110, 2, poll)).unwrap();
        w.finish(&EndInfo::default()).unwrap();
        let r = read_recording(&path).unwrap();
        let mut got: Vec<(u64, u64, u32)> = r
            .offcpu
            .iter()
            .filter(|o| o.dur_ns >= 2 * ms)
            .map(|o| (o.start_ns / 100_000, o.dur_ns / 100_000, o.stack))
            .collect();
        got.sort_unstable();
        // In 0.1 ms: the first (10 ms) and the last (70 ms) as written; 20-40 ms one run of
        // three (15 ms from 20 ms: 5 ms each); the lock's alone; 60 ms alone (a run of one).
        assert_eq!(
            got,
            vec![
                (100, 30, poll),
                (200, 50, poll),
                (250, 50, poll),
                (300, 50, poll),
                (500, 70, lock),
                (600, 80, poll),
                (700, 90, poll),
                (1100, 20, poll),
            ]
        );
        let total: u64 = r.offcpu.iter().map(|o| o.dur_ns).sum();
        assert_eq!(total, (3 + 4 + 5 + 6 + 7 + 8 + 9 + 1 + 2) * ms);
        assert_eq!(r.offcpu.len(), 9);
    }

    /// The same events written raw and aggregated: per-thread sums and counts of samples,
    /// off-CPU intervals, GIL waits and calls read back equal; every call duration within the
    /// bucket bound (so every quantile too); the API server's main thread (its event loop)
    /// and a thread seen running a task keep their raw events; the aggregated file is smaller.
    #[test]
    fn aggregated_events_read_back_with_exact_sums_and_counts() {
        use std::collections::BTreeMap;
        let dir = tempfile::tempdir().unwrap();
        let ms = 1_000_000u64;
        let (raw_path, agg_path) = (dir.path().join("raw.esrec"), dir.path().join("agg.esrec"));
        let raw_bytes = write_mixed_events(&raw_path, false);
        let agg_bytes = write_mixed_events(&agg_path, true);
        let raw = read_recording(&raw_path).unwrap();
        let agg = read_recording(&agg_path).unwrap();
        assert!(raw.profile_intervals.is_empty());
        assert_eq!(
            agg.profile_intervals.len(),
            10,
            "{:?}",
            agg.profile_intervals
        );
        assert!(
            agg_bytes * 4 < raw_bytes,
            "aggregated {agg_bytes} bytes, raw {raw_bytes}"
        );
        type Tot = BTreeMap<(i32, i32, u32, u8), (u64, u64)>;
        let tot = |r: &Recording| -> [Tot; 4] {
            let mut t: [Tot; 4] = Default::default();
            for s in &r.samples {
                let e = t[0].entry((s.pid, s.tid, s.stack, s.flags)).or_default();
                e.0 += 1;
                e.1 += s.weight_ns as u64;
            }
            for o in &r.offcpu {
                let e = t[1]
                    .entry((o.pid, o.tid, o.stack, o.preempted as u8))
                    .or_default();
                e.0 += 1;
                e.1 += o.dur_ns;
            }
            for g in &r.gil_waits {
                let e = t[2].entry((g.pid, g.tid, g.waiter_stack, 0)).or_default();
                e.0 += 1;
                e.1 += g.dur_ns;
            }
            for c in &r.calls {
                let e = t[3].entry((c.pid, c.tid, c.probe, 0)).or_default();
                e.0 += 1;
            }
            t
        };
        let (tr, ta) = (tot(&raw), tot(&agg));
        assert_eq!(tr[0].len(), 20, "5 threads x 2 stacks x 2 flags");
        for (k, (r, a)) in tr.iter().zip(&ta).enumerate() {
            assert_eq!(r, a, "kind {k}");
        }
        // Raw threads: the API server's main thread (7, 7) and the task thread (8, 11).
        for (pid, tid) in [(7, 7), (8, 11)] {
            let times = |r: &Recording| -> Vec<u64> {
                r.samples
                    .iter()
                    .filter(|s| (s.pid, s.tid) == (pid, tid))
                    .map(|s| s.t_ns)
                    .collect()
            };
            assert_eq!(times(&raw), times(&agg), "({pid}, {tid}) raw");
            // Its long blocks stay raw; the short ones are added up.
            let long = |r: &Recording| -> Vec<(u64, u64)> {
                r.offcpu
                    .iter()
                    .filter(|o| (o.pid, o.tid) == (pid, tid) && o.dur_ns >= 5 * ms)
                    .map(|o| (o.start_ns, o.dur_ns))
                    .collect()
            };
            assert!(!long(&raw).is_empty());
            assert_eq!(long(&raw), long(&agg), "({pid}, {tid}) long blocks raw");
        }
        assert_ne!(
            raw.samples
                .iter()
                .filter(|s| s.tid == 12)
                .map(|s| s.t_ns)
                .collect::<Vec<_>>(),
            agg.samples
                .iter()
                .filter(|s| s.tid == 12)
                .map(|s| s.t_ns)
                .collect::<Vec<_>>(),
            "another thread of the API server is aggregated"
        );
        // Calls: sorted durations pairwise within the bound, so every quantile is.
        let durs = |r: &Recording, tid: i32| -> Vec<u64> {
            let mut v: Vec<u64> = r
                .calls
                .iter()
                .filter(|c| c.tid == tid)
                .map(|c| c.dur_ns)
                .collect();
            v.sort_unstable();
            v
        };
        // Calls are aggregated on every thread (no view needs them one by one).
        for tid in [7, 8, 9, 11, 12] {
            let (a, b) = (durs(&raw, tid), durs(&agg, tid));
            assert_eq!(a.len(), b.len());
            assert!(a.len() >= 400);
            for (x, y) in a.iter().zip(&b) {
                let err = (*x as f64 - *y as f64).abs() / *x as f64;
                assert!(err <= profile::MAX_REL_ERROR, "{x} read back as {y}");
            }
        }
        // Events read back in time order, inside their intervals.
        assert!(agg.samples.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
    }

    /// A rotation writes the interval so far into the ending segment (its stack ids are only
    /// valid there); series an aggregating rotating writer does not keep lose their points.
    #[test]
    fn aggregated_rotation_closes_the_interval_and_keeps_only_read_series() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.esrec"), dir.path().join("b.esrec"));
        let meta = Meta::default();
        let mut w = RecordingWriter::create_rotating(&a, &meta).unwrap();
        w.aggregate(agg_opts(10_000_000_000));
        w.process(&ProcessInfo {
            pid: 8,
            ..Default::default()
        })
        .unwrap();
        w.engine(&EngineInfo {
            id: "engine0".into(),
            ..Default::default()
        })
        .unwrap();
        for (id, name) in ["vllm:kept_total", "vllm:dropped_total"].iter().enumerate() {
            w.series(&MetricSeries {
                id: id as u32,
                engine: "engine0".into(),
                name: name.to_string(),
                labels: Default::default(),
                kind: "counter".into(),
            })
            .unwrap();
            w.metric(&MetricPoint {
                t_ns: 5,
                series: id as u32,
                value: 1.0,
            })
            .unwrap();
        }
        let s = w.intern_stack(&[frame("x", 1)]).unwrap();
        for t in [1, 2, 3] {
            w.sample(&Sample {
                t_ns: t,
                pid: 8,
                tid: 8,
                stack: s,
                flags: 0,
                weight_ns: 7,
            })
            .unwrap();
        }
        w.rotate(
            &b,
            &meta,
            &EndInfo {
                duration_ns: 50,
                reason: "rotated".into(),
            },
            &|_, _| true,
        )
        .unwrap();
        let s2 = w.intern_stack(&[frame("y", 1)]).unwrap();
        w.sample(&Sample {
            t_ns: 4,
            pid: 8,
            tid: 8,
            stack: s2,
            flags: 0,
            weight_ns: 5,
        })
        .unwrap();
        w.finish(&EndInfo {
            duration_ns: 9,
            reason: "done".into(),
        })
        .unwrap();
        let r1 = read_recording(&a).unwrap();
        assert_eq!(r1.profile_intervals, [(0, 50)]);
        assert_eq!(r1.samples.len(), 3);
        assert_eq!(r1.samples.iter().map(|s| s.weight_ns).sum::<u32>(), 21);
        assert_eq!(
            r1.stack_frames(r1.samples[0].stack)
                .next()
                .unwrap()
                .function,
            "x"
        );
        assert_eq!(r1.series.len(), 1);
        assert_eq!(r1.series[0].name, "vllm:kept_total");
        assert_eq!(r1.metrics.len(), 1);
        let r2 = read_recording(&b).unwrap();
        assert_eq!(r2.profile_intervals, [(0, 9)]);
        assert_eq!(r2.samples.len(), 1);
        assert_eq!(
            r2.stack_frames(r2.samples[0].stack)
                .next()
                .unwrap()
                .function,
            "y"
        );
        assert_eq!(r2.series.len(), 1);
    }
}
