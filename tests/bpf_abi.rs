//! The Rust mirrors in src/bpf/abi.rs must have the layout the C compiler gives ebpf/sampler.h.

use enginescope::bpf::abi::*;
use std::mem::{offset_of, size_of};
use std::process::Command;

#[test]
fn rust_mirrors_match_the_c_header() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("layout.c");
    std::fs::write(
        &src,
        r#"#include <stdio.h>
#include <stddef.h>
#include <linux/types.h>
#include "sampler.h"
#define F(s, f) printf(#s "." #f "=%zu\n", offsetof(struct s, f))
#define S(s) printf(#s "=%zu\n", sizeof(struct s))
int main(void) {
  S(es_target); F(es_target, gil_holder_addr); F(es_target, gc_collecting_addr);
  F(es_target, code_type_addr); F(es_target, code_tag_mask); F(es_target, text_lo);
  F(es_target, text_hi); F(es_target, frame_kind); F(es_target, tstate_frame);
  F(es_target, cframe_current_frame); F(es_target, frame_previous); F(es_target, frame_code);
  F(es_target, frame_instr); F(es_target, frame_owner); F(es_target, code_firstlineno);
  F(es_target, code_adaptive); F(es_target, flags); F(es_target, code_name);
  F(es_target, gil_addr); F(es_target, gil_cond_off); F(es_target, gil_switch_off);
  F(es_target, gil_size); F(es_target, gc_stats_stride); F(es_target, gc_stats_addr);
  S(es_gc_edge); F(es_gc_edge, collections); F(es_gc_edge, collected); F(es_gc_edge, generation);
  S(es_probe_hit); F(es_probe_hit, frame); F(es_probe_hit, previous); F(es_probe_hit, code); F(es_probe_hit, value);
  S(es_thread); F(es_thread, tgid); F(es_thread, ustack_window);
  S(es_frame); F(es_frame, instr_offset); F(es_frame, code_id);
  S(es_event_header); F(es_event_header, flags); F(es_event_header, nframes);
  F(es_event_header, tgid); F(es_event_header, tid); F(es_event_header, cpu);
  F(es_event_header, time_ns); F(es_event_header, ip);
  F(es_target, frame_is_entry); F(es_target, gc_stats_ring); F(es_target, gc_ring_counts_off);
  F(es_target, gc_ring_off); F(es_target, gc_ring_slots);
  F(es_native, sp); F(es_native, bp); F(es_native, ustack_len); F(es_native, nkernel);
  F(es_native, kstack); F(es_native, ustack); S(es_native);
  printf("ES_MAX_KFRAMES=%d\nES_USTACK_MAX=%d\nES_FRAME_ENTRY=%d\n", ES_MAX_KFRAMES, ES_USTACK_MAX, ES_FRAME_ENTRY);
  printf("ES_MAX_FRAMES=%d\nES_C_COUNT=%d\nES_ABI_VERSION=%d\n", ES_MAX_FRAMES, ES_C_COUNT, ES_ABI_VERSION);
  printf("ES_OFF_SAMPLE=%d\nES_OFF_SWITCH=%d\nES_OFF_GC=%d\nES_OFF_PROBE=%d\nES_OFF_STACKS=%d\n", ES_OFF_SAMPLE, ES_OFF_SWITCH, ES_OFF_GC, ES_OFF_PROBE, ES_OFF_STACKS);
  return 0;
}
"#,
    )
    .unwrap();
    let bin = dir.path().join("layout");
    let cc = Command::new("cc")
        .arg(format!("-I{}/ebpf", env!("CARGO_MANIFEST_DIR")))
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .output()
        .unwrap();
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = String::from_utf8(Command::new(&bin).output().unwrap().stdout).unwrap();
    let c: std::collections::HashMap<&str, usize> = out
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    let rust: Vec<(&str, usize)> = vec![
        ("ES_OFF_SAMPLE", OFF_SAMPLE as usize),
        ("ES_OFF_SWITCH", OFF_SWITCH as usize),
        ("ES_OFF_GC", OFF_GC as usize),
        ("ES_OFF_PROBE", OFF_PROBE as usize),
        ("ES_OFF_STACKS", OFF_STACKS as usize),
        ("es_target", size_of::<EsTarget>()),
        (
            "es_target.gil_holder_addr",
            offset_of!(EsTarget, gil_holder_addr),
        ),
        (
            "es_target.gc_collecting_addr",
            offset_of!(EsTarget, gc_collecting_addr),
        ),
        (
            "es_target.code_type_addr",
            offset_of!(EsTarget, code_type_addr),
        ),
        (
            "es_target.code_tag_mask",
            offset_of!(EsTarget, code_tag_mask),
        ),
        ("es_target.text_lo", offset_of!(EsTarget, text_lo)),
        ("es_target.text_hi", offset_of!(EsTarget, text_hi)),
        ("es_target.frame_kind", offset_of!(EsTarget, frame_kind)),
        ("es_target.tstate_frame", offset_of!(EsTarget, tstate_frame)),
        (
            "es_target.cframe_current_frame",
            offset_of!(EsTarget, cframe_current_frame),
        ),
        (
            "es_target.frame_previous",
            offset_of!(EsTarget, frame_previous),
        ),
        ("es_target.frame_code", offset_of!(EsTarget, frame_code)),
        ("es_target.frame_instr", offset_of!(EsTarget, frame_instr)),
        ("es_target.frame_owner", offset_of!(EsTarget, frame_owner)),
        (
            "es_target.code_firstlineno",
            offset_of!(EsTarget, code_firstlineno),
        ),
        (
            "es_target.code_adaptive",
            offset_of!(EsTarget, code_adaptive),
        ),
        ("es_target.flags", offset_of!(EsTarget, flags)),
        ("es_target.code_name", offset_of!(EsTarget, code_name)),
        ("es_target.gil_addr", offset_of!(EsTarget, gil_addr)),
        ("es_target.gil_cond_off", offset_of!(EsTarget, gil_cond_off)),
        (
            "es_target.gil_switch_off",
            offset_of!(EsTarget, gil_switch_off),
        ),
        ("es_target.gil_size", offset_of!(EsTarget, gil_size)),
        (
            "es_target.gc_stats_stride",
            offset_of!(EsTarget, gc_stats_stride),
        ),
        (
            "es_target.gc_stats_addr",
            offset_of!(EsTarget, gc_stats_addr),
        ),
        ("es_gc_edge", GC_EDGE_SIZE),
        ("es_gc_edge.generation", size_of::<EsEventHeader>() + 48),
        ("es_gc_edge.collections", size_of::<EsEventHeader>()),
        ("es_gc_edge.collected", size_of::<EsEventHeader>() + 24),
        ("es_probe_hit", size_of::<EsEventHeader>() + 32),
        ("es_probe_hit.frame", size_of::<EsEventHeader>()),
        ("es_probe_hit.previous", size_of::<EsEventHeader>() + 8),
        ("es_probe_hit.code", size_of::<EsEventHeader>() + 16),
        ("es_probe_hit.value", size_of::<EsEventHeader>() + 24),
        ("es_thread", size_of::<EsThread>()),
        ("es_thread.tgid", offset_of!(EsThread, tgid)),
        (
            "es_thread.ustack_window",
            offset_of!(EsThread, ustack_window),
        ),
        ("es_frame", size_of::<EsFrame>()),
        ("es_frame.instr_offset", offset_of!(EsFrame, instr_offset)),
        ("es_frame.code_id", offset_of!(EsFrame, code_id)),
        ("es_event_header", size_of::<EsEventHeader>()),
        ("es_event_header.flags", offset_of!(EsEventHeader, flags)),
        (
            "es_event_header.nframes",
            offset_of!(EsEventHeader, nframes),
        ),
        ("es_event_header.tgid", offset_of!(EsEventHeader, tgid)),
        ("es_event_header.tid", offset_of!(EsEventHeader, tid)),
        ("es_event_header.cpu", offset_of!(EsEventHeader, cpu)),
        (
            "es_event_header.time_ns",
            offset_of!(EsEventHeader, time_ns),
        ),
        ("es_event_header.ip", offset_of!(EsEventHeader, ip)),
        ("ES_MAX_FRAMES", MAX_FRAMES),
        ("ES_MAX_KFRAMES", MAX_KFRAMES),
        ("ES_USTACK_MAX", USTACK_MAX),
        ("ES_FRAME_ENTRY", FRAME_ENTRY as usize),
        (
            "es_target.frame_is_entry",
            offset_of!(EsTarget, frame_is_entry),
        ),
        (
            "es_target.gc_stats_ring",
            offset_of!(EsTarget, gc_stats_ring),
        ),
        (
            "es_target.gc_ring_counts_off",
            offset_of!(EsTarget, gc_ring_counts_off),
        ),
        ("es_target.gc_ring_off", offset_of!(EsTarget, gc_ring_off)),
        (
            "es_target.gc_ring_slots",
            offset_of!(EsTarget, gc_ring_slots),
        ),
        ("es_native.sp", NATIVE_SP),
        ("es_native.bp", NATIVE_BP),
        ("es_native.ustack_len", NATIVE_USTACK_LEN),
        ("es_native.nkernel", NATIVE_NKERNEL),
        ("es_native.kstack", NATIVE_KSTACK),
        ("es_native.ustack", NATIVE_USTACK),
        ("es_native", NATIVE_USTACK + USTACK_MAX),
        ("ES_C_COUNT", COUNTER_NAMES.len()),
        ("ES_ABI_VERSION", ABI_VERSION as usize),
    ];
    for (k, v) in rust {
        assert_eq!(
            c.get(k),
            Some(&v),
            "{k}: C says {:?}, Rust says {v}",
            c.get(k)
        );
    }
}
