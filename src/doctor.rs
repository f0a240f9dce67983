//! `enginescope doctor`: what was detected in a target and what this machine allows, for bug
//! reports.

use std::fmt::Write as _;

use crate::cpython::PythonProcess;

pub use crate::sys::{machine_facts, MachineFacts};

pub fn report(p: Option<&PythonProcess>, as_json: bool) -> String {
    let m = machine_facts();
    if as_json {
        let target = p.map(|p| {
            serde_json::json!({
                "pid": p.pid,
                "version": p.version.to_string(),
                "version_source": p.version_source,
                "binary": &p.binary,
                "offsets": &p.offsets,
            })
        });
        return serde_json::to_string_pretty(&serde_json::json!({"machine": m, "target": target}))
            .unwrap_or_default();
    }
    let mut out = String::new();
    let _ = writeln!(out, "machine:");
    let _ = writeln!(out, "  kernel               {}", m.kernel);
    let _ = writeln!(out, "  euid                 {}", m.euid);
    let _ = writeln!(
        out,
        "  capabilities         {} (SYS_PTRACE {}, BPF {}, PERFMON {}, SYS_ADMIN {})",
        m.effective_caps, m.cap_sys_ptrace, m.cap_bpf, m.cap_perfmon, m.cap_sys_admin
    );
    let _ = writeln!(
        out,
        "  BTF                  {}",
        if m.btf {
            "yes (/sys/kernel/btf/vmlinux)"
        } else {
            "no"
        }
    );
    let _ = writeln!(out, "  perf_event_paranoid  {:?}", m.perf_event_paranoid);
    let _ = writeln!(out, "  yama ptrace_scope    {:?}", m.ptrace_scope);
    if let Some(p) = p {
        let b = &p.binary;
        let _ = writeln!(out, "target {}:", p.pid);
        let _ = writeln!(
            out,
            "  python               {} (from {})",
            p.version, p.version_source
        );
        let _ = writeln!(
            out,
            "  interpreter core     {} (opened via {})",
            b.path,
            b.opened_from.display()
        );
        let _ = writeln!(
            out,
            "  build                {}, {}, {}",
            if b.is_shared_lib {
                "shared libpython"
            } else {
                "static (libpython linked in)"
            },
            if b.pie { "PIE" } else { "non-PIE" },
            if b.stripped {
                "stripped (no .symtab)"
            } else {
                "with .symtab"
            }
        );
        let _ = writeln!(
            out,
            "  build-id             {}",
            b.build_id.as_deref().unwrap_or("-")
        );
        let _ = writeln!(out, "  load bias            {:#x}", b.bias);
        let _ = writeln!(
            out,
            "  _PyRuntime           {:#x} (found by {})",
            b.runtime_addr, b.runtime_found_by
        );
        let _ = writeln!(out, "  offsets              {:?}", p.offsets.source);
        let mut syms: Vec<_> = b.symbols.iter().collect();
        syms.sort();
        for (name, addr) in syms {
            let _ = writeln!(out, "  symbol               {name} = {addr:#x}");
        }
    }
    out
}

/// The BPF part of `doctor --pid`: whether the sampler loads here and what it sees in 0.5 s.
pub(crate) fn bpf_check(pid: i32) -> String {
    let mut out = String::from("bpf sampler:\n");
    if let Some(why) = crate::bpf::unavailable_reason() {
        let _ = writeln!(
            out,
            "  unavailable          {why} (record falls back to --backend memory)"
        );
        return out;
    }
    match crate::sampler::bpf_selftest(pid, std::time::Duration::from_millis(500)) {
        Ok(counters) => {
            let _ = writeln!(out, "  loaded and attached  0.5 s at 997 Hz per CPU");
            for (k, v) in counters {
                let _ = writeln!(out, "  {k:<28} {v}");
            }
        }
        Err(e) => {
            let _ = writeln!(out, "  failed               {e:#}");
        }
    }
    out
}
