//! Rust mirrors of `ebpf/sampler.h`. Each struct is `#[repr(C)]` with its size and key field
//! offsets asserted at compile time; `tests/bpf_abi.rs` compiles the C header and checks the
//! same numbers from the C side, so the two cannot drift apart silently.

#![allow(dead_code)]

pub const ABI_VERSION: u32 = 9;
pub const MAX_FRAMES: usize = 128;
pub const MAX_KFRAMES: usize = 64;
pub const USTACK_MAX: usize = 16384;
/// Bit or'ed into `EsFrame::instr_offset`: the frame was entered from C (`ES_FRAME_ENTRY`).
pub const FRAME_ENTRY: i32 = 0x4000_0000;

/// `struct es_target`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EsTarget {
    pub gil_locked_addr: u64,
    pub gil_holder_addr: u64,
    pub gc_collecting_addr: u64,
    pub code_type_addr: u64,
    pub code_tag_mask: u64,
    pub text_lo: u64,
    pub text_hi: u64,
    pub frame_kind: u32,
    pub tstate_frame: u32,
    pub cframe_current_frame: i32,
    pub frame_previous: u32,
    pub frame_code: u32,
    pub frame_instr: u32,
    pub frame_owner: i32,
    pub code_firstlineno: u32,
    pub code_adaptive: u32,
    pub flags: u32,
    pub code_name: u32,
    /// 3.11: offset of `_PyInterpreterFrame.is_entry`; -1 = none.
    pub frame_is_entry: i32,
    pub gil_addr: u64,
    pub gil_cond_off: u32,
    pub gil_switch_off: u32,
    pub gil_size: u32,
    pub gc_stats_stride: u32,
    pub gc_stats_addr: u64,
    /// Offset of the GIL's `mutex` (a glibc `pthread_mutex_t`, owner tid at +8); 0 = unknown.
    pub gil_mutex_off: u32,
    pub gil_switch_mutex_off: u32,
    /// 3.15: `gc_stats_addr` is the address of `gcstate->generation_stats`, a pointer to
    /// `struct gc_stats` (per-generation rings of cumulative records); 0 = inline array.
    pub gc_stats_ring: u32,
    /// Offset of `collections` (then `collected`) in one ring record.
    pub gc_ring_counts_off: u32,
    /// Offset of each generation's ring in `struct gc_stats`.
    pub gc_ring_off: [u32; 3],
    /// Records in each generation's ring; its `int8_t index` follows them.
    pub gc_ring_slots: [u32; 3],
}

pub(crate) const TARGET_OFFCPU: u32 = 1;
pub(crate) const TARGET_GIL: u32 = 2;
pub(crate) const TARGET_GC: u32 = 4;
/// GC pauses from a uprobe + uretprobe on the collector function (`ES_TARGET_GC_UPROBE`).
pub(crate) const TARGET_GC_UPROBE: u32 = 32;
/// A preempted switch-out sends no stack: the thread's last known one stands for it
/// (`ES_TARGET_PREEMPT_LAST`; the agent).
pub(crate) const TARGET_PREEMPT_LAST: u32 = 64;

/// Bits of the `control` map's value (`ES_OFF_*`): parts switched off, each program returning
/// at its first instruction (`record --measure-cost`'s off arms).
pub const OFF_SAMPLE: u32 = 1;
pub const OFF_SWITCH: u32 = 2;
pub const OFF_GC: u32 = 4;
pub const OFF_PROBE: u32 = 8;
/// The stack walks in the scheduler's hooks: switch-outs carry the last known stack.
pub const OFF_STACKS: u32 = 16;
pub(crate) const TARGET_KSTACK: u32 = 8;
pub(crate) const TARGET_USTACK: u32 = 16;

/// `struct es_thread`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EsThread {
    pub tstate: u64,
    pub tgid: u32,
    /// Bytes of user stack the kernel copies with a native stack (0 = all).
    pub ustack_window: u32,
}

/// `struct es_frame`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EsFrame {
    pub code: u64,
    pub instr_offset: i32,
    /// `co_firstlineno ^ (co_name >> 4)`, see [`code_id`].
    pub code_id: u32,
}

/// The identity the kernel computes for a code object (`struct es_frame.code_id`).
pub use crate::cpython::symbols::code_id;

impl From<EsFrame> for crate::cpython::symbols::RawFrame {
    fn from(f: EsFrame) -> Self {
        crate::cpython::symbols::RawFrame {
            code: f.code,
            instr_offset: f.instr_offset,
            code_id: f.code_id,
        }
    }
}

/// `struct es_event_header`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EsEventHeader {
    pub kind: u8,
    pub flags: u8,
    pub nframes: u16,
    pub tgid: u32,
    pub tid: u32,
    pub cpu: u32,
    pub time_ns: u64,
    pub ip: u64,
}

pub mod kind {
    pub(crate) const SAMPLE: u8 = 1;
    pub(crate) const SWITCH_OUT: u8 = 2;
    pub(crate) const SWITCH_IN: u8 = 3;
    pub(crate) const GIL_WAIT_START: u8 = 4;
    pub(crate) const GIL_WAIT_END: u8 = 5;
    pub(crate) const GC_EDGE: u8 = 6;
    pub(crate) const PROBE_HIT: u8 = 7;
    pub(crate) const NATIVE_STACK: u8 = 8;
    pub(crate) const WAKE: u8 = 9;
}

pub mod ev {
    pub const GIL: u8 = 1;
    pub const GC: u8 = 2;
    pub const NATIVE: u8 = 4;
    pub const KERNEL: u8 = 8;
    pub const PARTIAL: u8 = 16;
    pub(crate) const NO_TSTATE: u8 = 32;
    pub(crate) const TRUNCATED: u8 = 64;
    pub(crate) const PREEMPTED: u8 = 128;
    /// On SWITCH_OUT (same bit as KERNEL, which only SAMPLE uses): no frames were sent; the
    /// thread's stack is the one its last walked sample or switch-out carried.
    pub(crate) const SAME_STACK: u8 = 8;
    /// On GIL_WAIT_START (same bit as PREEMPTED, which only SWITCH_OUT uses).
    pub const SWITCH_WAIT: u8 = 128;
}

/// `enum es_counter`, in order.
pub const COUNTER_NAMES: &[&str] = &[
    "bpf_samples",
    "bpf_switch_out",
    "bpf_switch_in",
    "bpf_no_tstate",
    "bpf_read_frame_errors",
    "bpf_read_tstate_errors",
    "bpf_truncated_stacks",
    "bpf_ringbuf_full_lost",
    "bpf_skipped_shim_frames",
    "bpf_skipped_noncode_frames",
    "bpf_gil_read_errors",
    "bpf_gc_read_errors",
    "bpf_gil_waits",
    "bpf_gc_edges",
    "bpf_gil_wait_unpaired",
    "bpf_probe_hits",
    "bpf_probe_no_frame",
    "bpf_switch_native_skipped",
    "bpf_native_stacks",
    "bpf_ustack_read_errors",
    "bpf_kstack_errors",
    "bpf_gil_waits_on_mutex_owner",
    "bpf_gc_uprobe_hits",
    "bpf_gc_return_unpaired",
    "bpf_gc_nested_calls",
    "bpf_same_stack_switch_outs",
    "bpf_wakes",
    "bpf_code_reads",
    "bpf_frame_copies",
];

/// `struct es_native` after its header (offsets of its fields in the record).
pub const NATIVE_SP: usize = 32;
pub const NATIVE_BP: usize = 40;
pub const NATIVE_USTACK_LEN: usize = 48;
pub const NATIVE_NKERNEL: usize = 52;
pub const NATIVE_KSTACK: usize = 56;
pub const NATIVE_USTACK: usize = NATIVE_KSTACK + 8 * MAX_KFRAMES;

/// A NATIVE_STACK record: kernel return addresses, user registers and stack bytes, borrowed
/// from the ring buffer (the stack window is unwound in place, never copied).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NativeStack<'a> {
    pub tid: u32,
    pub time_ns: u64,
    /// User registers at the sample (0 = unknown).
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Kernel return addresses, innermost first, as 8-byte little-endian words.
    kernel_bytes: &'a [u8],
    /// User stack bytes from `sp` upwards.
    pub stack: &'a [u8],
}

impl NativeStack<'_> {
    /// Kernel return addresses, innermost first.
    pub fn kernel(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.kernel_bytes.chunks_exact(8).map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
    }
}

/// Parse a NATIVE_STACK record; `None` when malformed.
pub(crate) fn parse_native(bytes: &[u8]) -> Option<NativeStack<'_>> {
    let u64_at = |o: usize| -> Option<u64> {
        Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?))
    };
    let u32_at = |o: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(o..o + 4)?.try_into().ok()?))
    };
    if bytes.first() != Some(&kind::NATIVE_STACK) {
        return None;
    }
    let nk = (u16::from_le_bytes(
        bytes
            .get(NATIVE_NKERNEL..NATIVE_NKERNEL + 2)?
            .try_into()
            .ok()?,
    ) as usize)
        .min(MAX_KFRAMES);
    let ulen = (u32_at(NATIVE_USTACK_LEN)? as usize).min(USTACK_MAX);
    let kernel_bytes = bytes.get(NATIVE_KSTACK..NATIVE_KSTACK + 8 * nk)?;
    let stack = bytes.get(NATIVE_USTACK..NATIVE_USTACK + ulen)?;
    Some(NativeStack {
        tid: u32_at(8)?,
        time_ns: u64_at(16)?,
        ip: u64_at(24)?,
        sp: u64_at(NATIVE_SP)?,
        bp: u64_at(NATIVE_BP)?,
        kernel_bytes,
        stack,
    })
}

// SAFETY: plain-old-data #[repr(C)] structs without padding holes that matter to the kernel
// (every field is written), valid for any bit pattern.
unsafe impl aya::Pod for EsTarget {}
// SAFETY: as above.
unsafe impl aya::Pod for EsThread {}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<EsTarget>() == 176);
    assert!(offset_of!(EsTarget, gc_stats_ring) == 144);
    assert!(offset_of!(EsTarget, gc_ring_slots) == 164);
    assert!(offset_of!(EsTarget, gil_addr) == 104);
    assert!(offset_of!(EsTarget, gc_stats_addr) == 128);
    assert!(offset_of!(EsTarget, code_name) == 96);
    assert!(offset_of!(EsTarget, frame_kind) == 56);
    assert!(offset_of!(EsTarget, frame_owner) == 80);
    assert!(offset_of!(EsTarget, flags) == 92);
    assert!(size_of::<EsThread>() == 16);
    assert!(size_of::<EsFrame>() == 16);
    assert!(offset_of!(EsFrame, code_id) == 12);
    assert!(size_of::<EsEventHeader>() == 32);
    assert!(offset_of!(EsEventHeader, tid) == 8);
    assert!(offset_of!(EsEventHeader, time_ns) == 16);
    assert!(offset_of!(EsEventHeader, ip) == 24);
    assert!(offset_of!(EsTarget, frame_is_entry) == 100);
};

/// `struct es_gc_edge` after its header: per-generation (collections, collected), and the
/// collector's generation argument (uprobe method; -1 = none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcStats {
    pub collections: [u64; 3],
    pub collected: [u64; 3],
    pub generation_arg: i64,
}

impl Default for GcStats {
    fn default() -> Self {
        GcStats {
            collections: [0; 3],
            collected: [0; 3],
            generation_arg: -1,
        }
    }
}

/// Size of `struct es_gc_edge`.
pub const GC_EDGE_SIZE: usize = std::mem::size_of::<EsEventHeader>() + 56;

/// The statistics part of a GC_EDGE record.
pub(crate) fn parse_gc_stats(bytes: &[u8]) -> Option<GcStats> {
    let h = std::mem::size_of::<EsEventHeader>();
    let b = bytes.get(h..h + 56)?;
    let at = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    Some(GcStats {
        collections: [at(0), at(1), at(2)],
        collected: [at(3), at(4), at(5)],
        generation_arg: at(6) as i64,
    })
}

/// `struct es_probe_hit` after its header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProbeFrame {
    pub frame: u64,
    pub previous: u64,
    pub code: u64,
    /// The watched 8 bytes after the write: the probed code object's new `ob_refcnt`.
    pub value: u64,
}

/// The frame facts of a PROBE_HIT record.
pub(crate) fn parse_probe_frame(bytes: &[u8]) -> Option<ProbeFrame> {
    let h = std::mem::size_of::<EsEventHeader>();
    let b = bytes.get(h..h + 32)?;
    let at = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    Some(ProbeFrame {
        frame: at(0),
        previous: at(1),
        code: at(2),
        value: at(3),
    })
}

/// Parse one ring-buffer record: header and frames. `None` for a malformed record.
pub(crate) fn parse_event(bytes: &[u8]) -> Option<(EsEventHeader, Vec<EsFrame>)> {
    let hsize = std::mem::size_of::<EsEventHeader>();
    if bytes.len() < hsize {
        return None;
    }
    let u32_at =
        |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap_or([0; 8]));
    let h = EsEventHeader {
        kind: bytes[0],
        flags: bytes[1],
        nframes: u16::from_le_bytes([bytes[2], bytes[3]]),
        tgid: u32_at(4),
        tid: u32_at(8),
        cpu: u32_at(12),
        time_ns: u64_at(16),
        ip: u64_at(24),
    };
    if h.kind == kind::GC_EDGE || h.kind == kind::PROBE_HIT || h.kind == kind::NATIVE_STACK {
        return Some((h, Vec::new()));
    }
    let n = (h.nframes as usize).min(MAX_FRAMES);
    if bytes.len() < hsize + n * 16 {
        return None;
    }
    let frames = (0..n)
        .map(|i| {
            let o = hsize + i * 16;
            EsFrame {
                code: u64_at(o),
                instr_offset: u32_at(o + 8) as i32,
                code_id: u32_at(o + 12),
            }
        })
        .collect();
    Some((h, frames))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_parse_bounds() {
        assert!(parse_event(&[0; 31]).is_none());
        let mut b = vec![0u8; 32 + 16];
        b[0] = kind::SAMPLE;
        b[2] = 1; // one frame
        b[8] = 42;
        b[32] = 0x10;
        b[40] = 6;
        let (h, f) = parse_event(&b).unwrap();
        assert_eq!(h.tid, 42);
        assert_eq!(
            f,
            vec![EsFrame {
                code: 0x10,
                instr_offset: 6,
                code_id: 0
            }]
        );
        b[2] = 2; // claims two frames, has one
        assert!(parse_event(&b).is_none());
    }
}
