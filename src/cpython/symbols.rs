//! The symbolizer: raw frames (code object address, instruction offset, identity) to names and
//! lines, through a validated cache. One per target, used by both sources (the kernel's stack
//! walks and the memory source's) and, fresh, by `dump`.
//!
//! A code object is read once and cached by address; it stays valid while the address still
//! holds a code object with the same identity (`co_firstlineno` and the `co_name` pointer,
//! which every raw frame carries), so a freed address reused by another code object is noticed
//! and re-read. Lines are cached per (code, instruction offset).

use std::collections::HashSet;
use std::sync::Arc;

use crate::sys::FastMap;

use super::memory::MemorySource;
use super::objects::{self, CodeInfo};
use super::offsets::Offsets;
use crate::record::Frame;

/// One frame as read from the target, before symbolization (`struct es_frame` in the BPF
/// programs, the same fields from the user-space walk).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawFrame {
    pub code: u64,
    /// Byte offset of the current instruction in the code (3.10: `f_lasti * 2`); -1 if none.
    pub instr_offset: i32,
    /// [`code_id`] of the code object when the frame was read.
    pub code_id: u32,
}

/// The identity of a code object, as the kernel computes it: `co_firstlineno ^ (co_name >> 4)`.
pub fn code_id(firstlineno: i32, name_ptr: u64) -> u32 {
    (firstlineno as u32) ^ ((name_ptr >> 4) as u32)
}

/// A code object as cached.
struct CachedCode {
    id: u32,
    info: Arc<CodeInfo>,
}

/// Bounds: the target's memory is untrusted, and a long recording meets many code objects.
const MAX_LINES: usize = 1_000_000;
const MAX_NEW_CODE: usize = 100_000;

#[derive(Default)]
pub struct Symbolizer {
    code: FastMap<u64, CachedCode>,
    lines: FastMap<(u64, i32), Frame>,
    /// Frames that could not be resolved (code object gone or unreadable).
    pub unresolved_frames: u64,
    /// Code objects read again because their address now held another one.
    pub code_rereads: u64,
    /// When set, code objects read for the first time are queued in `new_code` (for probes).
    pub collect_new_code: bool,
    /// (code address, code object, thread whose stack it was met in).
    pub new_code: Vec<(u64, Arc<CodeInfo>, i32)>,
    /// The thread whose stack `resolve` is resolving (for `new_code`); 0 when unknown.
    pub resolving_tid: i32,
    /// Code objects first met in a stack of an unknown thread: queued in `new_code` at their
    /// next sighting in a known thread's stack.
    unattributed: HashSet<u64>,
}

impl Symbolizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Resolve raw frames (innermost first) of the process whose memory is `mem` (offsets
    /// `o`) to names and lines.
    pub fn resolve<F: Copy + Into<RawFrame>>(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        frames: &[F],
    ) -> Vec<Frame> {
        let kind = o.frame_kind;
        let mut out = Vec::with_capacity(frames.len());
        for &f in frames {
            let f: RawFrame = f.into();
            let key = (f.code, f.instr_offset);
            let fresh = self.code.get(&f.code).is_some_and(|c| c.id == f.code_id);
            if fresh
                && self.resolving_tid != 0
                && !self.unattributed.is_empty()
                && self.unattributed.remove(&f.code)
            {
                if let Some(c) = self.code.get(&f.code) {
                    self.new_code
                        .push((f.code, c.info.clone(), self.resolving_tid));
                }
            }
            if fresh {
                if let Some(fr) = self.lines.get(&key) {
                    out.push(fr.clone());
                    continue;
                }
            } else if !self.read_code(mem, o, f) {
                self.unresolved_frames += 1;
                out.push(Frame {
                    function: "<unknown>".into(),
                    file: String::new(),
                    line: None,
                });
                continue;
            }
            let Some(c) = self.code.get(&f.code) else {
                continue;
            };
            let fr = Frame {
                function: c.info.qualname.clone(),
                file: c.info.filename.clone(),
                line: c.info.line_at(kind, f.instr_offset as i64),
            };
            if self.lines.len() > MAX_LINES {
                self.lines.clear();
            }
            self.lines.insert(key, fr.clone());
            out.push(fr);
        }
        out
    }

    /// Read the code object of `f` into the cache; false if it cannot be read or is not the
    /// one the frame saw.
    fn read_code(&mut self, mem: &dyn MemorySource, o: &Offsets, f: RawFrame) -> bool {
        if self.code.remove(&f.code).is_some() {
            self.code_rereads += 1;
            self.lines.retain(|(c, _), _| *c != f.code);
        }
        let read = objects::read_code(mem, o, f.code)
            .ok()
            .zip(mem.read_u64(f.code.wrapping_add(o.code_name)).ok());
        let Some((info, name_ptr)) = read else {
            return false;
        };
        if code_id(info.firstlineno, name_ptr) != f.code_id {
            return false;
        }
        let info = Arc::new(info);
        if self.collect_new_code && self.new_code.len() < MAX_NEW_CODE {
            if self.resolving_tid != 0 {
                self.new_code
                    .push((f.code, info.clone(), self.resolving_tid));
            } else if self.unattributed.len() < MAX_NEW_CODE {
                self.unattributed.insert(f.code);
            }
        }
        self.code.insert(
            f.code,
            CachedCode {
                id: f.code_id,
                info,
            },
        );
        true
    }
}
