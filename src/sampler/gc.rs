//! How each target's GC pauses are timed, in one place: a uprobe + uretprobe on the
//! collector function (or uprobes on the stores that set and clear `gcstate->collecting`)
//! where the interpreter binary allows it, shared by every target running that binary; else a
//! write watchpoint on `gcstate->collecting` in every thread, set through the probes (which
//! share the threads' debug registers with it); else none. The method chosen for each process
//! is said once and written to the recording (`GcMethodInfo`). The BPF side is
//! `on_gc_enter`/`on_gc_exit`/`on_gc_clear` (uprobes) and `on_gc_write` (watchpoint) in
//! `ebpf/sampler.bpf.c`; the pauses are paired in the pipeline.

use std::collections::BTreeMap;
use std::time::Duration;

use super::probes::Probes;
use super::target::Target;
use super::Pipeline;
use crate::bpf::abi;
use crate::bpf::BpfSampler;
use crate::record::GcMethodInfo;
use crate::sys::monotonic_ns;

/// How long the end of a recording waits for the helper's uprobe closes.
const GC_UPROBE_CLOSE_WAIT: Duration = Duration::from_millis(300);

/// The GC uprobes on one interpreter binary and the targets they time.
struct SharedGcUprobes {
    links: crate::bpf::GcUprobes,
    /// The collector functions probed and how, for the method line.
    names: String,
    how: String,
    users: std::collections::BTreeSet<i32>,
}

/// A file's device and inode (what a uprobe is set on, whatever path reaches it).
fn file_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The GC side of the BPF source.
pub(crate) struct GcTracing {
    /// GC uprobes per interpreter binary (its device and inode), shared by the targets that
    /// run it: set when the first of them is attached, removed when the last exits.
    uprobes: std::collections::HashMap<(u64, u64), SharedGcUprobes>,
    /// GC methods chosen, to write at the next flush.
    pending: Vec<GcMethodInfo>,
    /// Processes whose GC uprobes could not be attached (counter `gc_uprobe_attach_failures`).
    uprobe_failures: u64,
    /// GC uprobe links still being closed by the helper when the recording ended (counter
    /// `gc_uprobe_closes_after_end`).
    closes_pending: u64,
    quiet: bool,
}

impl GcTracing {
    pub fn new(quiet: bool) -> Self {
        GcTracing {
            uprobes: std::collections::HashMap::new(),
            pending: Vec::new(),
            uprobe_failures: 0,
            closes_pending: 0,
            quiet,
        }
    }

    /// Exact GC pauses for `t`: a uprobe + uretprobe on the collector function where the
    /// interpreter has its symbol (no debug register, ~0.5 us per hit), else a write
    /// watchpoint on `gcstate->collecting` in every thread (one debug register per thread,
    /// ~14 us per hit). `ENGINESCOPE_GC_METHOD=watchpoint` skips the uprobe (measurements).
    pub(crate) fn configure(
        &mut self,
        b: &mut BpfSampler,
        probes: &mut Probes,
        t: &Target,
        cfg: &mut abi::EsTarget,
    ) {
        let forced = std::env::var("ENGINESCOPE_GC_METHOD").unwrap_or_default();
        let why_not_uprobe = if forced == "watchpoint" {
            "ENGINESCOPE_GC_METHOD=watchpoint".to_string()
        } else {
            match self.shared_uprobes(b, t) {
                Ok((names, how)) => {
                    cfg.flags |= abi::TARGET_GC_UPROBE;
                    let reason = format!("{how} in {}: no debug register", t.proc.binary.path);
                    let line = format!(
                        "GC pauses of process {}: exact, {how} (no debug register used)",
                        t.pid
                    );
                    self.method(t.pid, "uprobe", names, reason, &line);
                    return;
                }
                Err(e) => e,
            }
        };
        let tids: Vec<i32> = t.threads.keys().copied().collect();
        match probes.watch_gc(b, t.pid, cfg.gc_collecting_addr, &tids) {
            Ok(()) => {
                cfg.flags |= abi::TARGET_GC;
                let reason = format!(
                    "write watchpoint on gcstate->collecting, one debug register per thread (no uprobe: {why_not_uprobe})"
                );
                let line = format!(
                    "GC pauses of process {}: exact, write watchpoint on gcstate->collecting (one debug register per thread; no uprobe: {why_not_uprobe})",
                    t.pid
                );
                self.method(t.pid, "watchpoint", String::new(), reason, &line);
            }
            Err(e) => {
                let reason = format!("no uprobe ({why_not_uprobe}) and no watchpoint ({e:#})");
                let line = format!(
                    "no exact GC pauses for process {}: {e:#} (no uprobe: {why_not_uprobe})",
                    t.pid
                );
                self.method(t.pid, "none", String::new(), reason, &line);
            }
        }
    }

    /// Time `t`'s GC pauses with the uprobes on its interpreter binary, set now unless another
    /// target runs the same file; returns the functions probed and how, or why not.
    fn shared_uprobes(
        &mut self,
        b: &mut BpfSampler,
        t: &Target,
    ) -> Result<(String, String), String> {
        let bin = &t.proc.binary;
        let key = file_id(&bin.opened_from)
            .ok_or_else(|| format!("cannot stat {}", bin.opened_from.display()))?;
        if let Some(sh) = self.uprobes.get_mut(&key) {
            sh.users.insert(t.pid);
            return Ok((sh.names.clone(), sh.how.clone()));
        }
        let o = &t.proc.offsets;
        let cs = {
            let _s = crate::sys::steps::step("gc_collectors_decode");
            crate::cpython::binary::find_collectors(
                bin,
                t.proc.version.minor,
                o.interp_gc.wrapping_add(o.gc_collecting),
            )?
        };
        let _s = crate::sys::steps::step("gc_uprobes_attach");
        let links = b.attach_gc_uprobes(&cs).map_err(|e| {
            self.uprobe_failures += 1;
            format!("{e:#}")
        })?;
        let mut names: Vec<&str> = cs.iter().map(|c| c.name).collect();
        names.dedup();
        let names = names.join(", ");
        let how = if cs
            .iter()
            .all(|c| matches!(c.site, crate::cpython::binary::CollectorSite::Call { .. }))
        {
            let past: Vec<String> = cs
                .iter()
                .filter(|c| c.enter_file_offset != c.file_offset)
                .map(|c| format!("{}+{:#x}", c.name, c.enter_file_offset - c.file_offset))
                .collect();
            if past.is_empty() {
                format!("uprobe + uretprobe on {names}")
            } else {
                format!(
                    "uprobe + uretprobe on {names} (start probed at {}, past instructions the kernel would single-step)",
                    past.join(", ")
                )
            }
        } else {
            format!("uprobes on the stores that set and clear gcstate->collecting in {names}")
        };
        self.uprobes.insert(
            key,
            SharedGcUprobes {
                links,
                names: names.clone(),
                how: how.clone(),
                users: [t.pid].into(),
            },
        );
        Ok((names, how))
    }

    /// Record the GC method chosen for `pid` (written at the next collect) and say it.
    fn method(&mut self, pid: i32, method: &str, function: String, reason: String, line: &str) {
        if !self.quiet {
            eprintln!("enginescope: {line}");
        }
        self.pending.push(GcMethodInfo {
            pid,
            method: method.into(),
            function,
            reason,
            t_ns: 0,
        });
    }

    /// Whether a method chosen since the last flush times pauses with a watchpoint (whose
    /// pauses hold about one trap, which the pipeline subtracts once it is timed).
    pub(crate) fn needs_trap_cost(&self) -> bool {
        self.pending.iter().any(|g| g.method == "watchpoint")
    }

    /// Write the GC methods chosen since the last call and tell the pipeline which processes'
    /// pauses come from uprobes.
    pub fn flush(&mut self, pipe: &mut Pipeline) -> anyhow::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let now = pipe.rel(monotonic_ns());
        for mut g in std::mem::take(&mut self.pending) {
            if g.method == "uprobe" {
                pipe.gc_uprobe_pids.insert(g.pid);
            }
            g.t_ns = now;
            pipe.writer.gc_method(&g)?;
        }
        Ok(())
    }

    /// A target exited: the uprobes no other target uses are removed.
    pub(crate) fn process_gone(&mut self, b: &mut BpfSampler, pid: i32) {
        let mut unused = Vec::new();
        self.uprobes.retain(|_, sh| {
            sh.users.remove(&pid);
            if sh.users.is_empty() {
                unused.push(std::mem::take(&mut sh.links));
            }
            !sh.users.is_empty()
        });
        for u in unused {
            b.detach_gc_uprobes(u);
        }
    }

    /// The end: every uprobe removed, waiting a little for the helper's closes.
    pub fn finish(&mut self, b: &mut BpfSampler) {
        let _s = crate::sys::steps::step("finish_gc_uprobes");
        for (_, sh) in self.uprobes.drain() {
            b.detach_gc_uprobes(sh.links);
        }
        let left = b.wait_detached(GC_UPROBE_CLOSE_WAIT);
        if left > 0 && !self.quiet {
            eprintln!(
                "enginescope: {left} GC uprobe link(s) are still being removed by the helper process (es-uprobe-close): the kernel waits for grace periods; they are gone within seconds, whatever happens to enginescope"
            );
        }
        self.closes_pending = left as u64;
    }

    /// Counters `gc_uprobe_attach_failures` and `gc_uprobe_closes_after_end`.
    pub fn counters(&self, out: &mut BTreeMap<String, u64>) {
        out.insert("gc_uprobe_attach_failures".into(), self.uprobe_failures);
        out.insert("gc_uprobe_closes_after_end".into(), self.closes_pending);
    }
}
