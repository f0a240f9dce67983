//! pprof export: a gzipped `perftools.profiles.Profile` protobuf (go tool pprof, Pyroscope,
//! Grafana, speedscope all read it).
//!
//! Two sample types, `samples/count` and `cpu/nanoseconds` (the default). One pprof sample
//! per distinct (thread, stack, flags), labelled `pid`, `tid` (numbers) and `thread_name`.
//! Locations are Python frames (function + file, with the line); the synthetic frames for
//! sample flags (`[native]`, `[gc]`, ...) are locations too, so they show in pprof as in the
//! flamegraph.

use std::collections::HashMap;
use std::io::Write;

use anyhow::Context;
use prost::Message;

use super::{flag_leaves, Selection, PARTIAL_FRAME, SHAPE_FLAGS};
use crate::record::{flags, Recording};

/// The messages of `profile.proto` (github.com/google/pprof/proto/profile.proto) that this
/// export writes, declared with prost's derive so no protoc or build script is needed. Field
/// numbers follow the .proto file; fields we never write are left out (protobuf skips unknown
/// fields, so readers are unaffected).
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "7")]
        pub drop_frames: i64,
        #[prost(int64, tag = "8")]
        pub keep_frames: i64,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        /// Leaf first.
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
        #[prost(int64, tag = "3")]
        pub num: i64,
        #[prost(int64, tag = "4")]
        pub num_unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(int64, tag = "6")]
        pub build_id: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
        #[prost(bool, tag = "10")]
        pub has_inline_frames: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
        #[prost(bool, tag = "5")]
        pub is_folded: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
        #[prost(int64, tag = "5")]
        pub start_line: i64,
    }
}

/// Interned strings: index 0 is "" as the format requires.
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Strings {
            table: Vec::new(),
            index: HashMap::new(),
        };
        s.get("");
        s
    }

    fn get(&mut self, v: &str) -> i64 {
        if let Some(&i) = self.index.get(v) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(v.to_string());
        self.index.insert(v.to_string(), i);
        i
    }
}

/// Functions and locations, interned.
struct Symbols {
    functions: Vec<proto::Function>,
    function_ids: HashMap<(i64, i64), u64>,
    locations: Vec<proto::Location>,
    location_ids: HashMap<(u64, i64), u64>,
}

impl Symbols {
    fn location(&mut self, strings: &mut Strings, name: &str, file: &str, line: i64) -> u64 {
        self.location_at(strings, name, file, line, None)
    }

    /// A location; native and kernel frames carry their mapping and address.
    fn location_at(
        &mut self,
        strings: &mut Strings,
        name: &str,
        file: &str,
        line: i64,
        at: Option<(u64, u64)>,
    ) -> u64 {
        let key = (strings.get(name), strings.get(file));
        let next = self.functions.len() as u64 + 1;
        let fid = *self.function_ids.entry(key).or_insert(next);
        if fid == next {
            self.functions.push(proto::Function {
                id: fid,
                name: key.0,
                system_name: key.0,
                filename: key.1,
                start_line: 0,
            });
        }
        let next = self.locations.len() as u64 + 1;
        let lid = *self.location_ids.entry((fid, line)).or_insert(next);
        if lid == next {
            let (mapping_id, address) = at.unwrap_or((0, 0));
            self.locations.push(proto::Location {
                id: lid,
                mapping_id,
                address,
                line: vec![proto::Line {
                    function_id: fid,
                    line,
                }],
                ..Default::default()
            });
        }
        lid
    }
}

/// Build the profile (not yet encoded).
pub fn profile(rec: &Recording, sel: &Selection) -> proto::Profile {
    let mut b = Builder::new();
    b.add(rec, sel);
    let m = &rec.meta;
    let comment = [
        ("recorded by enginescope", &m.tool_version),
        ("backend", &m.backend),
        ("host", &m.hostname),
        ("command", &m.command),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .map(|(k, v)| format!("{k} {v}"))
    .collect::<Vec<_>>();
    b.finish(
        (rec.meta.start_unix_s * 1e9) as i64,
        i64::try_from(rec.duration_ns()).unwrap_or(i64::MAX),
        rec.meta
            .period()
            .map_or(0, |p| i64::try_from(p.ns()).unwrap_or(i64::MAX)),
        &comment,
    )
}

/// What a [`Builder`]'s profile counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// CPU samples: `samples/count`, `cpu/nanoseconds`.
    Cpu,
    /// Off-CPU intervals at the stack where each thread blocked (or was preempted: label
    /// `state`): `intervals/count`, `off_cpu/nanoseconds`.
    OffCpu,
    /// GIL waits at the waiting thread's stack, labelled with the holder (`gil_holder_tid`,
    /// `gil_holder`): `waits/count`, `gil_wait/nanoseconds`.
    GilWait,
}

impl Kind {
    /// (count type, count unit, time type): the time is in nanoseconds and the default.
    fn types(self) -> [&'static str; 3] {
        match self {
            Kind::Cpu => ["samples", "count", "cpu"],
            Kind::OffCpu => ["intervals", "count", "off_cpu"],
            Kind::GilWait => ["waits", "count", "gil_wait"],
        }
    }
}

/// One profile from several recordings (an agent's segments over a time range): functions,
/// locations and native mappings shared, one pprof sample per distinct (recording, thread,
/// stack, flags or state), in the order the recordings were added. Intervals (off CPU, GIL
/// waits) count the part of them inside the selection's time range.
pub(crate) struct Builder {
    kind: Kind,
    st: Strings,
    sym: Symbols,
    mappings: Vec<proto::Mapping>,
    mapping_ids: HashMap<String, usize>,
    samples: Vec<proto::Sample>,
    sample_type: Vec<proto::ValueType>,
    keys: [i64; 3],
}

impl Default for Builder {
    fn default() -> Self {
        Self::new()
    }
}

/// One pprof sample's key: thread, stack, sample flags, and a label of the kind's own.
type Key = (i32, i32, u32, u8, Option<(i64, i64)>);

impl Builder {
    /// A CPU profile.
    pub fn new() -> Self {
        Self::of(Kind::Cpu)
    }

    pub fn of(kind: Kind) -> Self {
        let mut st = Strings::new();
        let [count, unit, time] = kind.types();
        let sample_type = vec![
            proto::ValueType {
                r#type: st.get(count),
                unit: st.get(unit),
            },
            proto::ValueType {
                r#type: st.get(time),
                unit: st.get("nanoseconds"),
            },
        ];
        let keys = [st.get("pid"), st.get("tid"), st.get("thread_name")];
        Builder {
            kind,
            st,
            sym: Symbols {
                functions: Vec::new(),
                function_ids: HashMap::new(),
                locations: Vec::new(),
                location_ids: HashMap::new(),
            },
            mappings: Vec::new(),
            mapping_ids: HashMap::new(),
            samples: Vec::new(),
            sample_type,
            keys,
        }
    }

    /// The count and the total ns of every sample added.
    #[cfg(test)]
    pub fn totals(&self) -> (i64, i64) {
        self.samples
            .iter()
            .fold((0, 0), |(c, n), s| (c + s.value[0], n + s.value[1]))
    }

    /// Add what `sel` selects of `rec`: its samples, off-CPU intervals or GIL waits, as the
    /// builder's kind says.
    pub fn add(&mut self, rec: &Recording, sel: &Selection) {
        let mut by_key: HashMap<Key, (i64, i64)> = HashMap::new();
        let mut put = |k: Key, ns: u64| {
            let e = by_key.entry(k).or_default();
            e.0 += 1;
            e.1 += i64::try_from(ns).unwrap_or(i64::MAX);
        };
        // The labels of the kind's own (-1: none; a CPU profile's strings stay as they were).
        let st = &mut self.st;
        let (state, blocked, preempted, holder) = match self.kind {
            Kind::Cpu => (-1, -1, -1, -1),
            Kind::OffCpu => (st.get("state"), st.get("blocked"), st.get("preempted"), -1),
            Kind::GilWait => (-1, -1, -1, st.get("gil_holder_tid")),
        };
        match self.kind {
            Kind::Cpu => {
                for s in sel.samples(rec) {
                    let k = (s.pid, s.tid, s.stack, s.flags & SHAPE_FLAGS, None);
                    put(k, u64::from(s.weight_ns));
                }
            }
            Kind::OffCpu => {
                for o in sel.offcpu(rec) {
                    let v = if o.preempted { preempted } else { blocked };
                    let k = (o.pid, o.tid, o.stack, 0, Some((state, v)));
                    put(k, sel.clip(o.start_ns, o.dur_ns));
                }
            }
            Kind::GilWait => {
                for g in sel.gil_waits(rec) {
                    let k = (
                        g.pid,
                        g.tid,
                        g.waiter_stack,
                        0,
                        Some((holder, i64::from(g.holder_tid))),
                    );
                    put(k, sel.clip(g.start_ns, g.dur_ns));
                }
            }
        }
        // Deterministic output: sort by (pid, tid, stack, flags, label).
        let mut keys: Vec<_> = by_key.into_iter().collect();
        keys.sort_unstable_by_key(|&(k, _)| k);
        // Frame ids are the recording's own: its locations are looked up afresh.
        let mut frame_locs: HashMap<u32, u64> = HashMap::new();
        for ((pid, tid, stack, bits, extra), (count, ns)) in keys {
            let locs = self.locations(rec, stack, bits, &mut frame_locs);
            let mut label = self.thread_labels(rec, pid, tid);
            match extra {
                Some((k, v)) if k == holder => {
                    let holder_tid = i32::try_from(v).unwrap_or(0);
                    label.push(proto::Label {
                        key: k,
                        num: v,
                        ..Default::default()
                    });
                    if holder_tid != 0 {
                        let name = self.st.get(rec.thread_name(pid, holder_tid));
                        label.push(proto::Label {
                            key: self.st.get("gil_holder"),
                            str: name,
                            ..Default::default()
                        });
                    }
                }
                Some((k, v)) => label.push(proto::Label {
                    key: k,
                    str: v,
                    ..Default::default()
                }),
                None => {}
            }
            self.samples.push(proto::Sample {
                location_id: locs,
                value: vec![count, ns],
                label,
            });
        }
    }

    /// A sample's locations, leaf first: the flags' synthetic frames, the stack's frames, and
    /// the partial-stack marker.
    fn locations(
        &mut self,
        rec: &Recording,
        stack: u32,
        bits: u8,
        frame_locs: &mut HashMap<u32, u64>,
    ) -> Vec<u64> {
        let mut locs = Vec::new();
        for leaf in flag_leaves(bits).collect::<Vec<_>>().into_iter().rev() {
            locs.push(self.sym.location(&mut self.st, leaf, "", 0));
        }
        for &fid in rec
            .stacks
            .get(stack as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            let Some(f) = rec.frames.get(fid as usize) else {
                continue;
            };
            let loc = match frame_locs.get(&fid) {
                Some(&l) => l,
                None => {
                    let at = rec.frame_native.get(&fid).map(|n| self.mapping(n));
                    let l = self.sym.location_at(
                        &mut self.st,
                        &f.function,
                        &f.file,
                        i64::from(f.line.unwrap_or(0)),
                        at,
                    );
                    frame_locs.insert(fid, l);
                    l
                }
            };
            locs.push(loc);
        }
        if bits & flags::PARTIAL != 0 {
            locs.push(self.sym.location(&mut self.st, PARTIAL_FRAME, "", 0));
        }
        locs
    }

    fn thread_labels(&mut self, rec: &Recording, pid: i32, tid: i32) -> Vec<proto::Label> {
        let [k_pid, k_tid, k_name] = self.keys;
        let name = self.st.get(rec.thread_name(pid, tid));
        vec![
            proto::Label {
                key: k_pid,
                num: i64::from(pid),
                ..Default::default()
            },
            proto::Label {
                key: k_tid,
                num: i64::from(tid),
                ..Default::default()
            },
            proto::Label {
                key: k_name,
                str: name,
                ..Default::default()
            },
        ]
    }

    /// Native and kernel frames: one mapping per module (addresses are the module's own, ELF
    /// vaddr, so one mapping serves every process that maps it; the kernel's are absolute).
    fn mapping(&mut self, n: &crate::record::NativeFrameInfo) -> (u64, u64) {
        let st = &mut self.st;
        let mappings = &mut self.mappings;
        let i = *self.mapping_ids.entry(n.module.clone()).or_insert_with(|| {
            mappings.push(proto::Mapping {
                id: mappings.len() as u64 + 1,
                memory_start: u64::MAX,
                memory_limit: 0,
                filename: st.get(&n.module),
                build_id: st.get(&n.build_id),
                has_functions: true,
                ..Default::default()
            });
            mappings.len() - 1
        });
        let m = &mut self.mappings[i];
        m.memory_start = m.memory_start.min(n.addr);
        m.memory_limit = m.memory_limit.max(n.addr.saturating_add(1));
        (m.id, n.addr)
    }

    /// The profile: `time_nanos` and `duration_nanos` what it covers, `period` the sampling
    /// period (0: unknown), `comment` free lines.
    pub fn finish(
        mut self,
        time_nanos: i64,
        duration_nanos: i64,
        period: i64,
        comment: &[String],
    ) -> proto::Profile {
        let time = self.kind.types()[2];
        let period_type = proto::ValueType {
            r#type: self.st.get(time),
            unit: self.st.get("nanoseconds"),
        };
        let comment = comment.iter().map(|c| self.st.get(c)).collect();
        let default_sample_type = self.st.get(time);
        proto::Profile {
            sample_type: self.sample_type,
            sample: self.samples,
            mapping: self.mappings,
            location: self.sym.locations,
            function: self.sym.functions,
            time_nanos,
            duration_nanos,
            period_type: Some(period_type),
            period,
            comment,
            default_sample_type,
            string_table: self.st.table,
            ..Default::default()
        }
    }
}

/// The profile, protobuf-encoded and gzipped.
pub fn encode(p: &proto::Profile) -> anyhow::Result<Vec<u8>> {
    let raw = p.encode_to_vec();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&raw)
        .context("compressing the pprof profile")?;
    gz.finish().context("compressing the pprof profile")
}

/// The export: the profile, protobuf-encoded and gzipped.
pub fn render(rec: &Recording, sel: &Selection) -> anyhow::Result<Vec<u8>> {
    encode(&profile(rec, sel))
}

/// Read back a gzipped (or plain) profile; for tests and tools.
pub fn decode(bytes: &[u8]) -> anyhow::Result<proto::Profile> {
    let raw = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(bytes), &mut out)
            .context("decompressing the pprof profile")?;
        out
    } else {
        bytes.to_vec()
    };
    proto::Profile::decode(raw.as_slice()).context("decoding the pprof profile")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::synth::*;

    fn rec() -> Recording {
        let mut r = Rec::new().thread(1, 2, "waiter").thread(1, 3, "holder");
        let stack = r.stack(&["blocked_here"], "w.py");
        // 100-300 ms blocked, 250-400 ms preempted; a GIL wait 150-250 ms behind tid 3.
        r.offcpu_at((1, 2), 100 * MS, 200 * MS, stack, false);
        r.offcpu_at((1, 2), 250 * MS, 150 * MS, stack, true);
        r.gil_wait(1, 2, 150 * MS, 100 * MS, 3, 0);
        r.waiting_at(stack);
        r.0
    }

    fn label<'a>(p: &'a proto::Profile, s: &proto::Sample, key: &str) -> (&'a str, i64) {
        let st = |i: i64| p.string_table[i as usize].as_str();
        let l = s.label.iter().find(|l| st(l.key) == key).unwrap();
        (st(l.str), l.num)
    }

    #[test]
    fn intervals_count_their_part_inside_the_window_with_their_labels() {
        let r = rec();
        // The window 200-300 ms: 100 ms of the blocked interval, 50 of the preempted one.
        let sel = Selection::all(&r).during(200_000_000, 300_000_000);
        let mut b = Builder::of(Kind::OffCpu);
        b.add(&r, &sel);
        assert_eq!(b.totals(), (2, 150_000_000));
        let p = b.finish(0, 100_000_000, 0, &[]);
        assert_eq!(p.string_table[p.sample_type[1].r#type as usize], "off_cpu");
        assert_eq!(p.string_table[p.default_sample_type as usize], "off_cpu");
        let states: Vec<(&str, i64)> = p
            .sample
            .iter()
            .map(|s| (label(&p, s, "state").0, s.value[1]))
            .collect();
        assert_eq!(
            states,
            [("blocked", 100_000_000), ("preempted", 50_000_000)]
        );

        let mut b = Builder::of(Kind::GilWait);
        b.add(&r, &sel);
        assert_eq!(b.totals(), (1, 50_000_000));
        let p = b.finish(0, 100_000_000, 0, &[]);
        let s = &p.sample[0];
        assert_eq!(label(&p, s, "gil_holder_tid").1, 3);
        assert_eq!(label(&p, s, "gil_holder").0, "holder");
        assert_eq!(label(&p, s, "thread_name").0, "waiter");
        let leaf = &p.location[s.location_id[0] as usize - 1];
        let f = &p.function[leaf.line[0].function_id as usize - 1];
        assert_eq!(p.string_table[f.name as usize], "blocked_here");

        // Without a window, whole; CPU profiles carry none of these labels.
        let mut b = Builder::of(Kind::OffCpu);
        b.add(&r, &Selection::all(&r));
        assert_eq!(b.totals(), (2, 350_000_000));
        let p = profile(&r, &Selection::all(&r));
        assert!(!p
            .string_table
            .iter()
            .any(|s| s == "state" || s == "gil_holder_tid"));
    }
}
