//! speedscope export (https://www.speedscope.app/file-format-schema.json): shared frames, one
//! "sampled" profile per thread with samples in time order, weights in nanoseconds. Off-CPU
//! intervals are not included: speedscope's sampled profiles have no notion of them.

use std::collections::HashMap;

use anyhow::Context;
use serde::Serialize;

use super::{flag_leaves, process_label, thread_label, Selection, PARTIAL_FRAME, SHAPE_FLAGS};
use crate::record::{flags, Recording};

pub(crate) const SCHEMA: &str = "https://www.speedscope.app/file-format-schema.json";

#[derive(Debug, Serialize)]
pub struct File {
    #[serde(rename = "$schema")]
    pub schema: &'static str,
    pub shared: Shared,
    pub profiles: Vec<Profile>,
    pub name: String,
    #[serde(rename = "activeProfileIndex")]
    pub active_profile_index: usize,
    pub exporter: String,
}

#[derive(Debug, Serialize)]
pub struct Shared {
    pub frames: Vec<Frame>,
}

#[derive(Debug, Serialize, PartialEq, Eq, Hash, Clone)]
pub struct Frame {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<i32>,
}

#[derive(Debug, Serialize)]
pub struct Profile {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub name: String,
    pub unit: &'static str,
    #[serde(rename = "startValue")]
    pub start_value: u64,
    #[serde(rename = "endValue")]
    pub end_value: u64,
    /// Stacks as indices into `shared.frames`, root first.
    pub samples: Vec<Vec<usize>>,
    pub weights: Vec<u64>,
}

struct Frames {
    list: Vec<Frame>,
    index: HashMap<Frame, usize>,
}

impl Frames {
    fn get(&mut self, f: Frame) -> usize {
        if let Some(&i) = self.index.get(&f) {
            return i;
        }
        let i = self.list.len();
        self.list.push(f.clone());
        self.index.insert(f, i);
        i
    }

    fn synthetic(&mut self, name: &str) -> usize {
        self.get(Frame {
            name: name.to_string(),
            file: None,
            line: None,
        })
    }
}

/// One sample of a thread: time, index into the distinct stacks, weight (ns).
struct Timed {
    t_ns: u64,
    stack: usize,
    weight_ns: u64,
}

/// Build the document.
pub fn build(rec: &Recording, sel: &Selection) -> File {
    let mut frames = Frames {
        list: Vec::new(),
        index: HashMap::new(),
    };
    // Recording frame id -> speedscope frame index.
    let mut mapped: HashMap<u32, usize> = HashMap::new();
    // Distinct (stack, flags) -> index into `stack_list` (root-first frame indices).
    let mut stacks: HashMap<(u32, u8), usize> = HashMap::new();
    let mut stack_list: Vec<Vec<usize>> = Vec::new();
    let mut per_thread: HashMap<(i32, i32), Vec<Timed>> = HashMap::new();
    for s in sel.samples(rec) {
        let bits = s.flags & SHAPE_FLAGS;
        let st = *stacks.entry((s.stack, bits)).or_insert_with(|| {
            let mut v = Vec::new();
            if bits & flags::PARTIAL != 0 {
                v.push(frames.synthetic(PARTIAL_FRAME));
            }
            let ids = rec
                .stacks
                .get(s.stack as usize)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            for &fid in ids.iter().rev() {
                let Some(f) = rec.frames.get(fid as usize) else {
                    continue;
                };
                let i = *mapped.entry(fid).or_insert_with(|| {
                    frames.get(Frame {
                        name: f.function.clone(),
                        file: Some(f.file.clone()).filter(|f| !f.is_empty()),
                        line: f.line,
                    })
                });
                v.push(i);
            }
            for leaf in flag_leaves(bits) {
                v.push(frames.synthetic(leaf));
            }
            stack_list.push(v);
            stack_list.len() - 1
        });
        per_thread.entry((s.pid, s.tid)).or_default().push(Timed {
            t_ns: s.t_ns,
            stack: st,
            weight_ns: u64::from(s.weight_ns),
        });
    }
    let mut profiles = Vec::new();
    for (pid, tid) in sel.threads() {
        let Some(mut v) = per_thread.remove(&(pid, tid)) else {
            continue;
        };
        // Time order (the file is in time order per CPU, not globally); stable for ties.
        v.sort_by_key(|x| x.t_ns);
        let total: u64 = v.iter().map(|x| x.weight_ns).sum();
        profiles.push(Profile {
            kind: "sampled",
            name: format!(
                "{} — {}",
                thread_label(rec, pid, tid),
                process_label(rec, pid)
            ),
            unit: "nanoseconds",
            start_value: 0,
            end_value: total,
            weights: v.iter().map(|x| x.weight_ns).collect(),
            samples: v.iter().map(|x| stack_list[x.stack].clone()).collect(),
        });
    }
    let name = {
        let pids = sel.pids();
        let targets: Vec<String> = pids.iter().map(|&p| process_label(rec, p)).collect();
        format!("enginescope: {}", targets.join(", "))
    };
    // Open on the busiest thread.
    let active_profile_index = profiles
        .iter()
        .enumerate()
        .max_by_key(|(i, p)| (p.end_value, std::cmp::Reverse(*i)))
        .map_or(0, |(i, _)| i);
    File {
        schema: SCHEMA,
        shared: Shared {
            frames: frames.list,
        },
        profiles,
        name,
        active_profile_index,
        exporter: format!("enginescope {}", env!("CARGO_PKG_VERSION")),
    }
}

pub fn render(rec: &Recording, sel: &Selection) -> anyhow::Result<Vec<u8>> {
    serde_json::to_vec(&build(rec, sel)).context("serializing the speedscope profile")
}
