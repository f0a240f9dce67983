//! The kernel side's user-space half: load `ebpf/sampler.bpf.o` with aya, attach it, feed it
//! targets and threads, drain its ring buffer, read its counters.
//!
//! Everything attached here is owned by file descriptors of this process: when enginescope
//! exits, however it exits (SIGKILL included), the kernel detaches and frees all of it.

pub mod abi;
mod clock;
pub mod closer;
pub mod watchers;

use anyhow::{anyhow, bail, Context};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::{BtfTracePoint, PerfEvent};
use aya::{Btf, Ebpf, EbpfLoader};

pub use abi::{EsEventHeader, EsFrame, EsTarget, EsThread};

/// The BPF object: built by build.rs when clang is present, else the committed one.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/sampler.bpf.o"));

/// Why BPF cannot be used here, in words a user can act on.
pub(crate) fn unavailable_reason() -> Option<String> {
    let facts = crate::sys::machine_facts();
    if facts.euid != 0 && !(facts.cap_bpf && facts.cap_perfmon) {
        return Some("not root and no CAP_BPF+CAP_PERFMON (run with sudo, or `setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep enginescope`)".into());
    }
    if !facts.btf {
        return Some(
            "the kernel has no BTF (/sys/kernel/btf/vmlinux missing; needs CONFIG_DEBUG_INFO_BTF)"
                .into(),
        );
    }
    None
}

/// A loaded and attached sampler.
pub(crate) struct BpfSampler {
    bpf: Ebpf,
    ring: RingBuf<MapData>,
    targets: BpfHashMap<MapData, u32, EsTarget>,
    threads: BpfHashMap<MapData, u32, EsThread>,
    /// `code_seen`: the code objects walks read lately, keyed by (address, tgid) (`struct
    /// es_code_key`, 16 bytes; its value 16 bytes too).
    code_seen: BpfHashMap<MapData, [u8; 16], [u8; 16]>,
    /// Per thread id besides `threads`: the identity of its last walked stack (`last_walk`,
    /// 24 bytes), when its GIL wait began (`gil_waiting`), its GC nesting (`gc_depth`).
    last_walk: BpfHashMap<MapData, u32, [u8; 24]>,
    gil_waiting: BpfHashMap<MapData, u32, u64>,
    gc_depth: BpfHashMap<MapData, u32, u32>,
    counters: PerCpuArray<MapData, u64>,
    /// The parts switched off (`ES_OFF_*`, one value).
    control: Array<MapData, u32>,
    /// Held while the kernel times BPF programs (unless `ENGINESCOPE_BPF_STATS=0`).
    stats: Option<std::os::fd::OwnedFd>,
    /// Threads closing uprobe links (see [`detach_gc_uprobes`](Self::detach_gc_uprobes)),
    /// joined before the sampler goes: only where the helper below could not take them.
    detaching: Vec<std::thread::JoinHandle<()>>,
    /// The process that makes uprobe links' last close (`closer`), forked before the first
    /// GC uprobe is attached; `None` before that, or if it could not be started.
    closer: Option<closer::UprobeCloser>,
    /// Links closed on a thread of ours because the helper could not take them.
    closed_here: u64,
    /// Sets and removes probe watchpoints off the loop; started on first use.
    switcher: Option<Switcher>,
    /// Keeps the kernel's context-switch hooks for per-thread perf events on while we set
    /// and remove watchpoints ([`SchedHooksHeld`]); opened before the first one.
    sched_hooks: Option<SchedHooksHeld>,
    /// Watchpoints on every CPU, pointed at one address at a time
    /// ([`watch_refcount_cpus`](Self::watch_refcount_cpus)).
    cpu_slots: Vec<std::sync::Arc<CpuSlot>>,
    /// Why the kernel refused a new one (no more are tried).
    cpu_slots_refused: Option<String>,
    /// The slots being opened off the loop ([`CpuSlot::open_all`]).
    cpu_slots_coming: Option<std::sync::mpsc::Receiver<Result<Vec<CpuSlot>, String>>>,
    /// Whether slots on every CPU may be opened (not while another enginescope on the host
    /// watches probes: [`watchers`]), and the last ones released, true once closed.
    cpu_slots_allowed: bool,
    cpu_slots_closing: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The cpu-clock events that run `on_sample`, one per CPU.
    clock: clock::SampleClock,
}

impl Drop for BpfSampler {
    fn drop(&mut self) {
        self.wait_detached(std::time::Duration::ZERO);
    }
}

/// What one watchpoint hit costs the thread that takes it, ns
/// ([`BpfSampler::watchpoint_costs_ns`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TrapCost {
    /// The trap alone (what a GC pause timed between two hits includes).
    pub hot: u64,
    /// The trap and the cache lines it costs code working on its own data (what a probed
    /// engine pays; at least `hot`).
    pub in_use: u64,
}

impl BpfSampler {
    /// Load the programs, start cpu-clock sampling on every online CPU at `rate_hz`, and (when
    /// `offcpu`) trace sched_switch. Nothing is recorded until targets are added.
    pub fn start(rate_hz: u32, offcpu: bool) -> anyhow::Result<Self> {
        Self::start_with(rate_hz, offcpu, false)
    }

    /// As [`start`](Self::start); with `gil`, also time the waits of targets' threads on
    /// their GILs (a thread falling asleep in futex(2) on the GIL, to its switch-in).
    pub(crate) fn start_with(rate_hz: u32, offcpu: bool, gil: bool) -> anyhow::Result<Self> {
        Self::start_sized(rate_hz, offcpu, gil, None)
    }

    /// As [`start_with`](Self::start_with), with a ring buffer of `ring_bytes` (a power of two)
    /// instead of the object's 8 MiB: native stacks send ~17 KiB per event.
    pub(crate) fn start_sized(
        rate_hz: u32,
        offcpu: bool,
        gil: bool,
        ring_bytes: Option<u32>,
    ) -> anyhow::Result<Self> {
        // Parse the kernel's BTF once: CO-RE relocation and every tp_btf program use it, and
        // each parse costs tens of MB of peak memory.
        let btf = Btf::from_sys_fs().context("reading kernel BTF (/sys/kernel/btf/vmlinux)")?;
        let mut loader = EbpfLoader::new();
        loader.btf(Some(&btf));
        if let Some(n) = ring_bytes {
            loader.map_max_entries("events", n);
        }
        let mut bpf = loader
            .load(OBJECT)
            .map_err(|e| anyhow!("loading the BPF object failed: {e:#}"))?;
        let period_ns = 1_000_000_000u64 / rate_hz.max(1) as u64;
        let clock = {
            let prog: &mut PerfEvent = bpf
                .program_mut("on_sample")
                .context("BPF object has no on_sample program")?
                .try_into()?;
            prog.load()
                .map_err(|e| anyhow!("verifier rejected on_sample: {e:#}"))?;
            let cpus = aya::util::online_cpus().map_err(|(what, e)| anyhow!("{what}: {e}"))?;
            // Our own events rather than aya's attach: their period is re-drawn while
            // recording (clock.rs: a fixed grid keeps step with targets paced by timers).
            let prog_fd = raw_fd(prog).context("on_sample is not loaded")?;
            clock::SampleClock::open(prog_fd, &cpus, period_ns)?
        };
        // GIL waits are timed from the switches too (a thread falling asleep in futex(2) on
        // the GIL, and its switch-in): no program runs on other system calls.
        if offcpu || gil {
            attach_tp_btf(&mut bpf, "on_switch", "sched_switch", &btf)?;
        }
        // What ended a sleep: a wake from another thread of the process (a lock released, a
        // condition notified), with the waker's stack.
        if offcpu {
            attach_tp_btf(&mut bpf, "on_waking", "sched_waking", &btf)?;
        }
        drop(btf);
        // The parsed BTF was the largest allocation; hand its pages back to the kernel.
        // SAFETY: malloc_trim only releases free heap memory.
        unsafe {
            libc::malloc_trim(0);
        }
        let ring = RingBuf::try_from(bpf.take_map("events").context("no events map")?)?;
        let targets = BpfHashMap::try_from(bpf.take_map("targets").context("no targets map")?)?;
        let threads = BpfHashMap::try_from(bpf.take_map("threads").context("no threads map")?)?;
        let code_seen =
            BpfHashMap::try_from(bpf.take_map("code_seen").context("no code_seen map")?)?;
        let last_walk =
            BpfHashMap::try_from(bpf.take_map("last_walk").context("no last_walk map")?)?;
        let gil_waiting =
            BpfHashMap::try_from(bpf.take_map("gil_waiting").context("no gil_waiting map")?)?;
        let gc_depth = BpfHashMap::try_from(bpf.take_map("gc_depth").context("no gc_depth map")?)?;
        let counters = PerCpuArray::try_from(bpf.take_map("counters").context("no counters map")?)?;
        let control = Array::try_from(bpf.take_map("control").context("no control map")?)?;
        // Have the kernel time every BPF program run (BPF_ENABLE_STATS, for as long as the fd
        // is held; it adds two clock reads per run, ~0.1 µs against the 1-7 µs a run of ours
        // takes), so that what the recording costs in its targets' context is the kernel's
        // own figure (`bpf_prog_run_ns`, the report's "What recording cost"), not a guess.
        // `ENGINESCOPE_BPF_STATS=0` leaves the kernel's setting alone.
        let stats = std::env::var("ENGINESCOPE_BPF_STATS")
            .map_or(true, |v| v != "0")
            .then(|| aya::sys::enable_stats(aya::sys::Stats::RunTime).ok())
            .flatten();
        Ok(BpfSampler {
            bpf,
            ring,
            targets,
            threads,
            code_seen,
            last_walk,
            gil_waiting,
            gc_depth,
            counters,
            control,
            stats,
            detaching: Vec::new(),
            closer: None,
            closed_here: 0,
            switcher: None,
            sched_hooks: None,
            cpu_slots: Vec::new(),
            cpu_slots_refused: None,
            cpu_slots_coming: None,
            cpu_slots_allowed: true,
            cpu_slots_closing: None,
            clock,
        })
    }

    /// `on_gc_write`, loaded on first use.
    fn gc_write_program(&mut self) -> anyhow::Result<&mut PerfEvent> {
        let prog: &mut PerfEvent = self
            .bpf
            .program_mut("on_gc_write")
            .context("BPF object has no on_gc_write program")?
            .try_into()?;
        if prog.fd().is_err() {
            prog.load()
                .map_err(|e| anyhow!("verifier rejected on_gc_write: {e:#}"))?;
        }
        Ok(prog)
    }

    /// `on_probe_hit`, loaded on first use.
    fn probe_program(&mut self) -> anyhow::Result<&mut PerfEvent> {
        let prog: &mut PerfEvent = self
            .bpf
            .program_mut("on_probe_hit")
            .context("BPF object has no on_probe_hit program")?
            .try_into()?;
        if prog.fd().is_err() {
            prog.load()
                .map_err(|e| anyhow!("verifier rejected on_probe_hit: {e:#}"))?;
        }
        Ok(prog)
    }

    /// Open [`SchedHooksHeld`] once, before the first watchpoint (where the kernel refuses it,
    /// watchpoints still work, as slowly to set as before).
    fn hold_sched_hooks(&mut self) {
        if self.sched_hooks.is_none() {
            self.sched_hooks = SchedHooksHeld::open().ok();
        }
    }

    /// The helper thread that sets and removes probe watchpoints, started the first time one
    /// is asked for (None where it cannot be started: the caller then does it itself).
    fn switcher(&mut self) -> Option<&Switcher> {
        if self.switcher.is_none() {
            self.switcher = Switcher::spawn().ok();
        }
        self.switcher.as_ref()
    }

    /// Set a write watchpoint on the 8 bytes at `addr` (a probed code object's `ob_refcnt` in
    /// the target) for thread `tid` only, running `on_probe_hit` on each write. One debug
    /// register per thread; the kernel refuses (ENOSPC) when the thread has none left.
    pub(crate) fn watch_refcount(&mut self, tid: i32, addr: u64) -> anyhow::Result<Breakpoint> {
        let addr = probe_address(addr);
        self.hold_sched_hooks();
        let prog_fd =
            raw_fd(self.probe_program()?).map_err(|e| anyhow!("on_probe_hit not loaded: {e}"))?;
        let set = match self.switcher() {
            Some(sw) => {
                let (reply, rx) = std::sync::mpsc::sync_channel(1);
                let job = SwitchJob::Open {
                    prog_fd,
                    tid,
                    addr,
                    len: 8,
                    reply,
                };
                if sw.tx.send(job).is_ok() {
                    match rx.recv_timeout(SET_LIMIT) {
                        Ok(r) => r,
                        Err(_) => Err(std::io::Error::other(format!(
                            "not set within {} s (the kernel retries while the thread moves between CPUs)",
                            SET_LIMIT.as_secs()
                        ))),
                    }
                } else {
                    self.switcher = None;
                    Breakpoint::write_fd(prog_fd, tid, addr, 8)
                }
            }
            None => Breakpoint::write_fd(prog_fd, tid, addr, 8),
        };
        set.map_err(|e| anyhow!("watchpoint at {addr:#x} on thread {tid}: {e}"))
    }

    /// The most watchpoints [`watch_refcount_cpus`](Self::watch_refcount_cpus) sets at once:
    /// each reserves a debug register on every CPU, and threads watched on their own (every
    /// call of a thread whose probes are cheap, a GC watchpoint) need one of the four too.
    pub(crate) const CPU_SLOTS: usize = 3;

    /// Set a write watchpoint on the 8 bytes at `addr` on every CPU ([`CpuSlot`]), running
    /// `on_probe_hit` on each write by any thread: for a thread whose probes are watched in
    /// on-phases, so that it pays no debug-register reload at its context switches. A free slot
    /// is re-pointed (an IPI to each CPU); the slots, up to [`CPU_SLOTS`](Self::CPU_SLOTS), are
    /// opened together off the loop the first time one is asked for
    /// ([`take_cpu_slots`](Self::take_cpu_slots)). Err while they are being opened, when none
    /// is free, or when the kernel refused them: the caller sets a thread's watchpoint
    /// instead.
    pub(crate) fn watch_refcount_cpus(&mut self, addr: u64) -> anyhow::Result<Breakpoint> {
        use std::sync::atomic::Ordering;
        let addr = probe_address(addr);
        self.take_cpu_slots()?;
        let slot = self
            .cpu_slots
            .iter()
            .find(|s| !s.in_use.load(Ordering::Acquire))
            .cloned()
            .ok_or_else(|| {
                anyhow!(
                    "all {} watchpoint slots on every CPU in use",
                    self.cpu_slots.len()
                )
            })?;
        slot.point(Some(addr))
            .map_err(|e| anyhow!("watchpoint at {addr:#x} on every CPU: {e}"))?;
        slot.in_use.store(true, Ordering::Release);
        Ok(Breakpoint {
            _kind: BreakpointKind::Cpus {
                _held: CpuWatchHeld(slot),
            },
        })
    }

    /// The slots on every CPU, opened on a thread of their own the first time they are asked
    /// for (opening one waits for the kernel's grace period, up to 0.75 s beside a loaded
    /// engine, which the recording loop must not: measured, it fell back to normal priority):
    /// Err until they are there, or when the kernel refused them.
    fn take_cpu_slots(&mut self) -> anyhow::Result<()> {
        if !self.cpu_slots_allowed {
            anyhow::bail!(
                "watchpoints on every CPU: another enginescope on this host watches probes"
            );
        }
        if let Some(why) = &self.cpu_slots_refused {
            anyhow::bail!("watchpoints on every CPU refused: {why}");
        }
        if !self.cpu_slots.is_empty() {
            return Ok(());
        }
        let Some(rx) = &self.cpu_slots_coming else {
            let prog_fd = raw_fd(self.probe_program()?)
                .map_err(|e| anyhow!("on_probe_hit not loaded: {e}"))?;
            let cpus = aya::util::online_cpus().map_err(|(what, e)| anyhow!("{what}: {e}"))?;
            let (tx, rx) = std::sync::mpsc::channel();
            // The program's descriptor stays open while the sampler lives; a thread still
            // opening when it goes finds its sends unanswered and drops what it opened.
            std::thread::Builder::new()
                .name("es-watch-cpus".into())
                .spawn(move || {
                    let _ = tx.send(CpuSlot::open_all(prog_fd, &cpus, Self::CPU_SLOTS));
                })
                .map_err(|e| {
                    self.cpu_slots_refused = Some(format!("no thread to open them: {e}"));
                    anyhow!("watchpoints on every CPU: {e}")
                })?;
            self.cpu_slots_coming = Some(rx);
            anyhow::bail!("watchpoints on every CPU being opened");
        };
        match rx.try_recv() {
            Ok(Ok(slots)) => {
                self.cpu_slots = slots.into_iter().map(std::sync::Arc::new).collect();
                self.cpu_slots_coming = None;
                Ok(())
            }
            Ok(Err(e)) => {
                self.cpu_slots_refused = Some(e.clone());
                self.cpu_slots_coming = None;
                anyhow::bail!("watchpoints on every CPU: {e}")
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => {
                anyhow::bail!("watchpoints on every CPU being opened")
            }
            Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                self.cpu_slots_refused = Some("the thread opening them ended".into());
                self.cpu_slots_coming = None;
                anyhow::bail!("watchpoints on every CPU: the thread opening them ended")
            }
        }
    }

    /// Allow slots on every CPU, or not (another enginescope on the host watches probes:
    /// [`watchers`]): not allowed, those open are closed once no watch uses them (a watch
    /// ends with its on-phase), off the loop (a close can wait for the kernel), and the
    /// probes' next on-phases use their threads' own watchpoints; they are opened again the
    /// next time one is asked for once allowed.
    pub(crate) fn allow_cpu_slots(&mut self, allowed: bool) {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        if allowed {
            if !self.cpu_slots_allowed {
                // Refused while another held registers: asked again.
                self.cpu_slots_refused = None;
            }
            self.cpu_slots_allowed = true;
            return;
        }
        self.cpu_slots_allowed = false;
        // Slots being opened: the opening thread finds its send unanswered and closes them.
        self.cpu_slots_coming = None;
        if self.cpu_slots.is_empty()
            || self
                .cpu_slots
                .iter()
                .any(|s| s.in_use.load(Ordering::Acquire))
        {
            return;
        }
        let slots = std::mem::take(&mut self.cpu_slots);
        let closed = Arc::new(AtomicBool::new(false));
        let done = closed.clone();
        let close = move || {
            drop(slots);
            done.store(true, Ordering::Release);
        };
        // Without a thread, the closure and its slots are dropped (closed) here.
        if std::thread::Builder::new()
            .name("es-watch-close".into())
            .spawn(close)
            .is_err()
        {
            closed.store(true, Ordering::Release);
        }
        self.cpu_slots_closing = Some(closed);
    }

    /// Whether this process holds slots on every CPU now (open, being opened, or being
    /// closed).
    pub(crate) fn holds_cpu_slots(&self) -> bool {
        !self.cpu_slots.is_empty()
            || self.cpu_slots_coming.is_some()
            || self
                .cpu_slots_closing
                .as_ref()
                .is_some_and(|c| !c.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Remove a watchpoint set by [`watch_refcount`](Self::watch_refcount): handed to the
    /// helper thread that closes it ([`Switcher`]), or closed here if it cannot be started.
    /// One set on every CPU is disabled here (an IPI to each CPU), so that its slot is free
    /// for the next setting.
    pub(crate) fn unwatch_refcount(&mut self, w: Breakpoint) {
        if w.on_every_cpu() {
            drop(w);
            return;
        }
        match self.switcher() {
            Some(sw) => {
                if let Err(e) = sw.tx.send(SwitchJob::Close(w)) {
                    self.switcher = None;
                    drop(e.0);
                }
            }
            None => drop(w),
        }
    }

    /// Set a write watchpoint on `addr` (4 bytes, a target's `gcstate->collecting`) for thread
    /// `tid` only, running `on_gc_write` on each write. Per-thread watchpoints take one debug
    /// register in each watched thread, however many processes are watched (a CPU-wide one
    /// takes one on every CPU per process, which leaves none for probes with 3+ targets).
    pub(crate) fn watch_gc_thread(&mut self, tid: i32, addr: u64) -> anyhow::Result<Breakpoint> {
        self.hold_sched_hooks();
        let prog = self.gc_write_program()?;
        Breakpoint::write(prog, tid, addr, 4)
            .map_err(|e| anyhow!("GC watchpoint at {addr:#x} on thread {tid}: {e}"))
    }

    /// Time GC pauses of the target processes running one interpreter binary with a uprobe
    /// on each function of `collectors` and a uretprobe on its return (programs
    /// `on_gc_enter` / `on_gc_exit`, loaded on first use; the attach cookie says whether the
    /// function's second argument is the generation). They take no debug register.
    ///
    /// The probes are set once for the file, in every process that maps it, and the programs
    /// return at once in a process that is not a target with GC uprobes (a map lookup, on a
    /// collector call: a few hundred a second at most). Probes scoped to one process would cost
    /// an attach and a detach each time a process starts and exits, and closing a uprobe waits
    /// for a kernel grace period under the lock that attaching takes too (measured here:
    /// ~110 ms a link, 0.9 s for one process's 8, which stalled the recording loop of an agent
    /// over a fleet whose workers come and go). Owned by this process's file descriptors: the
    /// kernel removes them, and the return trampolines of calls still inside the collector
    /// return normally, when enginescope exits however it exits. All or nothing.
    pub(crate) fn attach_gc_uprobes(
        &mut self,
        collectors: &[crate::cpython::binary::Collector],
    ) -> anyhow::Result<GcUprobes> {
        use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope};
        use aya::programs::UProbe;
        let scope = UProbeScope::AllProcesses;
        if self.closer.is_none() {
            // Before the first uprobe exists (the fork copies every descriptor). If it cannot
            // start, links are closed on threads of ours as before (`gc_uprobe_links_closed_here`).
            match closer::UprobeCloser::spawn() {
                Ok(c) => self.closer = Some(c),
                Err(e) => eprintln!(
                    "enginescope: could not start the process that removes GC uprobes ({e}); \
                     a SIGKILL while they are removed may leave them in the traced processes"
                ),
            }
        }
        let mut links = GcUprobes { links: Vec::new() };
        use crate::cpython::binary::CollectorSite;
        for c in collectors {
            let (programs, cookie): (&[&'static str], bool) = match c.site {
                CollectorSite::Call { generation_arg } => {
                    (&["on_gc_enter", "on_gc_exit"], generation_arg)
                }
                CollectorSite::FlagSet => (&["on_gc_enter"], false),
                CollectorSite::FlagClear => (&["on_gc_clear"], false),
            };
            for &name in programs {
                let prog: &mut UProbe = self
                    .bpf
                    .program_mut(name)
                    .with_context(|| format!("BPF object has no {name} program"))?
                    .try_into()?;
                if prog.fd().is_err() {
                    prog.load()
                        .map_err(|e| anyhow!("verifier rejected {name}: {e:#}"))?;
                }
                // A call's start may be probed past its entry (`Collector::enter_file_offset`);
                // its uretprobe must be at the entry, where the return address is on top of
                // the stack.
                let offset = if name == "on_gc_enter" {
                    c.enter_file_offset
                } else {
                    c.file_offset
                };
                let point = UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(offset),
                    cookie: Some(u64::from(cookie)),
                };
                match prog.attach(point, &c.path, scope) {
                    Ok(l) => links.links.push((name, l)),
                    Err(e) => {
                        let err = anyhow!(
                            "{name} on {} at {}+{:#x}: {}",
                            c.name,
                            c.path.display(),
                            offset,
                            os_error(&e)
                        );
                        self.detach_gc_uprobes(links);
                        return Err(err);
                    }
                }
            }
        }
        Ok(links)
    }

    /// Remove uprobes set by [`attach_gc_uprobes`](Self::attach_gc_uprobes), off the caller's
    /// thread: closing a uprobe waits for a kernel grace period (~110 ms a link here). Each
    /// link is handed to the helper process that makes its last close ([`closer`]: a kill of
    /// enginescope during a close of its own would leave the probe in every process of that
    /// interpreter), or where that fails closed on a short-lived thread of ours. Either way
    /// [`wait_detached`](Self::wait_detached) waits for them.
    pub(crate) fn detach_gc_uprobes(&mut self, u: GcUprobes) {
        let mut taken = Vec::with_capacity(u.links.len());
        for (name, l) in u.links {
            if let Some(prog) = self.bpf.program_mut(name) {
                let prog: Result<&mut aya::programs::UProbe, _> = prog.try_into();
                if let Ok(prog) = prog {
                    if let Ok(link) = prog.take_link(l) {
                        taken.push(link);
                    }
                }
            }
        }
        self.detaching.retain(|h| !h.is_finished());
        let mut left = Vec::new();
        let _s = crate::sys::steps::step("gc_uprobes_hand_over");
        let fds = if self.closer.is_some() {
            link_fds()
        } else {
            Default::default()
        };
        for link in taken {
            match self.closer.as_mut() {
                Some(c) => {
                    if let Err(link) = hand_over_link(c, link, &fds) {
                        left.push(link);
                    }
                }
                None => left.push(link),
            }
        }
        if let Some(c) = self.closer.as_mut() {
            c.collect(std::time::Duration::ZERO);
        }
        self.closed_here += left.len() as u64;
        for link in left {
            // A failed spawn drops its closure, and the link with it, here.
            if let Ok(h) = std::thread::Builder::new()
                .name("es-detach".into())
                .stack_size(64 * 1024)
                .spawn(move || drop(link))
            {
                self.detaching.push(h);
            }
        }
    }

    /// Wait until the uprobe links being closed are closed. A thread killed while it closes one
    /// (the process exiting around it) can leave the probe's breakpoint in the traced
    /// processes' code: the kernel's write of the original byte fails under a pending fatal
    /// signal. So the recording joins them before it ends, and the sampler before it goes.
    ///
    /// The helper's closes are waited for at most `wait`: they are safe whatever happens to
    /// enginescope (that is the helper's purpose), and each waits for kernel grace periods
    /// (0.1 s on an idle machine, seconds under load), which a user who stops a recording
    /// should not wait for. Returns how many links were still being closed.
    pub(crate) fn wait_detached(&mut self, wait: std::time::Duration) -> usize {
        for h in self.detaching.drain(..) {
            let _ = h.join();
        }
        match self.closer.as_mut() {
            Some(c) => {
                let _s = crate::sys::steps::step("gc_uprobes_closed");
                c.collect(wait)
            }
            None => 0,
        }
    }

    /// Remove a watchpoint set by [`watch_gc_thread`](Self::watch_gc_thread).
    pub(crate) fn unwatch_gc_thread(&mut self, w: Breakpoint) {
        drop(w);
    }

    /// What one watchpoint hit costs the writing thread here, ns, two ways ([`TrapCost`]),
    /// measured on a variable of our own (not a target, so the program returns at once):
    /// alone (`hot`: a GC pause measured between two hits includes about one, which `record`
    /// subtracts), and, with `in_use`, what it costs code that works on data of its own
    /// between hits (a trap's path through the kernel, and in a VM the hypervisor, evicts
    /// cache lines that code must then fetch again, which a loop of bare writes never pays; on
    /// a real vLLM on an Intel VM the throughput each trap cost was about twice `hot`).
    /// Without `in_use`, `in_use` is `hot`: its runs pass over a working set between writes
    /// and cost the calling thread ~50-100 ms of CPU, which only the probe budget needs.
    pub(crate) fn watchpoint_costs_ns(&mut self, in_use: bool) -> anyhow::Result<TrapCost> {
        self.hold_sched_hooks();
        static mut PROBE: u32 = 0;
        // Batches of writes timed on this thread's CPU clock (time the thread spends
        // preempted on a busy machine is not trap cost), the cheapest batch kept: a mean over
        // one long batch read 172 µs per trap on a 2-core machine at load 15 where the traps
        // inside probed calls cost ~45 µs.
        const BATCHES: u32 = 16;
        const N: u32 = 100;
        // Between two writes of the working-set runs, a pass over WORKING_SET bytes (one load
        // per cache line): data the code in use keeps close.
        const WORKING_SET: usize = 256 << 10;
        let addr = std::ptr::addr_of_mut!(PROBE);
        let prog = self.gc_write_program()?;
        let cpu_ns = || {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: clock_gettime writes the timespec we pass; no other preconditions.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
            ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
        };
        let data = vec![1u8; WORKING_SET];
        let write_n = |touch: bool| {
            let mut best = u64::MAX;
            let mut sum = 0u64;
            for _ in 0..BATCHES {
                let t0 = cpu_ns();
                for i in 0..N {
                    if touch {
                        for line in data.iter().step_by(64) {
                            // SAFETY: a reference to a live byte of `data`; volatile so that
                            // the pass is not folded away.
                            sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(line) } as u64);
                        }
                    }
                    // SAFETY: a private static only this function touches, written through a
                    // raw pointer with volatile stores so that every write reaches memory.
                    unsafe { std::ptr::write_volatile(addr, i) };
                }
                best = best.min(cpu_ns().saturating_sub(t0));
            }
            std::hint::black_box(sum);
            best
        };
        let (base, base_ws) = (write_n(false), if in_use { write_n(true) } else { 0 });
        // This thread (the one that writes below), not the process's main thread: `record`
        // may run on a thread of its own (top, demo, agent).
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        let w = Breakpoint::write(prog, me, addr as u64, 4)
            .map_err(|e| anyhow!("setting a calibration watchpoint: {e}"))?;
        let (watched, watched_ws) = (write_n(false), if in_use { write_n(true) } else { 0 });
        drop(w);
        let hot = watched.saturating_sub(base) / N as u64;
        let in_use = (watched_ws.saturating_sub(base_ws) / N as u64).max(hot);
        Ok(TrapCost { hot, in_use })
    }

    /// What a thread holding write watchpoints pays per context switch here, over one that
    /// holds none ([`SwitchCost`]): the kernel writes the debug registers each time such a
    /// thread is switched in or out, and in a VM each write may exit to the hypervisor. A
    /// thread that yields thousands of times a second (vLLM's busy-wait on its shared-memory
    /// queue) pays this far more often than it takes a trap.
    ///
    /// Measured on this thread and a helper, both pinned to the CPU this thread is on,
    /// yielding to each other in batches; the cheapest batch of each kind is kept (time
    /// another task took on that CPU is not switch cost). The threads' affinity is restored.
    pub(crate) fn watched_switch_cost_ns(&mut self) -> anyhow::Result<SwitchCost> {
        self.hold_sched_hooks();
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        static mut SLOTS: [u64; 4] = [0; 4];
        const BATCHES: usize = 6;
        const N: u64 = 200;
        let prog = self.gc_write_program()?;
        // SAFETY: sched_getcpu and gettid have no preconditions.
        let (cpu, me) = unsafe { (libc::sched_getcpu(), libc::gettid()) };
        if cpu < 0 {
            bail!("sched_getcpu failed: {}", std::io::Error::last_os_error());
        }
        let realtime = crate::sys::is_realtime_this_thread();
        let stop = Arc::new(AtomicBool::new(false));
        // The helper takes this thread's policy, then pins itself, and says so; only then is
        // this thread pinned too (a real-time thread pinned first would keep a helper of
        // normal priority from ever running on that CPU).
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<bool>();
        let helper = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("es-switch-cal".into())
                .spawn(move || {
                    // The same policy as the measuring thread, or its yields would not
                    // switch to this one.
                    let same = !realtime || crate::sys::realtime_this_thread().is_ok();
                    let pinned = same && crate::sys::pin(0, cpu as usize).is_ok();
                    let _ = ready_tx.send(pinned);
                    if !pinned {
                        return;
                    }
                    // Bounded: the measuring thread sets `stop` however it ends; the cap is
                    // for the case it could not.
                    for _ in 0..10_000_000u32 {
                        if stop.load(Ordering::Acquire) {
                            break;
                        }
                        // SAFETY: sched_yield has no preconditions.
                        unsafe { libc::sched_yield() };
                    }
                })
                .context("starting the switch-calibration thread")?
        };
        let pinned = ready_rx
            .recv_timeout(std::time::Duration::from_secs(1))
            .unwrap_or(false);
        let saved = crate::sys::affinity(0);
        let measure = |regs: usize, prog: &PerfEvent| -> anyhow::Result<u64> {
            let base = std::ptr::addr_of_mut!(SLOTS) as u64;
            let mut held = Vec::new();
            for i in 0..regs {
                held.push(
                    Breakpoint::write(prog, me, base + 8 * i as u64, 8)
                        .map_err(|e| anyhow!("setting a calibration watchpoint: {e}"))?,
                );
            }
            let mut best = u64::MAX;
            for _ in 0..BATCHES {
                let t0 = crate::sys::monotonic_ns();
                for _ in 0..N {
                    // SAFETY: sched_yield has no preconditions.
                    unsafe { libc::sched_yield() };
                }
                best = best.min(crate::sys::monotonic_ns().saturating_sub(t0) / N);
            }
            drop(held);
            Ok(best)
        };
        let result = (|| {
            if !pinned {
                bail!("the helper thread could not take this thread's policy and CPU {cpu}");
            }
            let saved = saved
                .as_ref()
                .map_err(|e| anyhow!("reading this thread's CPU affinity: {e}"))?;
            crate::sys::pin(0, cpu as usize).context("pinning this thread for the calibration")?;
            let r = (|| {
                let none = measure(0, prog)?;
                let one = measure(1, prog)?;
                let four = measure(4, prog)?;
                Ok(SwitchCost {
                    one_ns: one.saturating_sub(none),
                    four_ns: four.saturating_sub(none).max(one.saturating_sub(none)),
                })
            })();
            let _ = crate::sys::set_affinity(0, saved);
            r
        })();
        stop.store(true, Ordering::Release);
        let _ = helper.join();
        result
    }

    pub(crate) fn set_target(&mut self, tgid: u32, t: &EsTarget) -> anyhow::Result<()> {
        self.targets
            .insert(tgid, *t, 0)
            .context("updating the targets map")
    }

    /// Stop recording process `tgid`, and forget the code objects its walks read (an LRU map
    /// would drop them in time; an agent whose engines restart should hold nothing of the
    /// gone ones).
    pub(crate) fn remove_target(&mut self, tgid: u32) {
        let _ = self.targets.remove(&tgid);
        let gone: Vec<[u8; 16]> = self
            .code_seen
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k[8..12] == tgid.to_ne_bytes())
            .collect();
        for k in gone {
            let _ = self.code_seen.remove(&k);
        }
    }

    pub(crate) fn set_thread(&mut self, tid: u32, t: &EsThread) -> anyhow::Result<()> {
        self.threads
            .insert(tid, *t, 0)
            .context("updating the threads map")
    }

    /// Set how much user stack the kernel copies for thread `tid` (0 = all); nothing for a
    /// thread not in the map (gone).
    pub(crate) fn set_thread_window(&mut self, tid: u32, window: u32) -> anyhow::Result<()> {
        let Ok(mut t) = self.threads.get(&tid, 0) else {
            return Ok(());
        };
        if t.ustack_window == window {
            return Ok(());
        }
        t.ustack_window = window;
        self.set_thread(tid, &t)
    }

    /// Forget thread `tid` in every per-thread map: a thread that died with an entry (in a GIL
    /// wait, inside a collection, after a walk that left its identity) would otherwise hold it
    /// until the map's end (`gil_waiting` is not an LRU map: once full, GIL waits would go
    /// untimed), and an agent outlives many engines' threads.
    pub(crate) fn remove_thread(&mut self, tid: u32) {
        let _ = self.threads.remove(&tid);
        let _ = self.last_walk.remove(&tid);
        let _ = self.gil_waiting.remove(&tid);
        let _ = self.gc_depth.remove(&tid);
    }

    /// Hand every pending ring-buffer record to `f`, at most `max` of them.
    pub fn drain(&mut self, max: usize, mut f: impl FnMut(&[u8])) -> usize {
        let mut n = 0;
        while n < max {
            let Some(item) = self.ring.next() else { break };
            f(&item);
            n += 1;
        }
        n
    }

    /// Switch off the parts in `mask` (`abi::OFF_*`; 0 = everything on): each of their
    /// programs returns at its first instruction from now on.
    pub(crate) fn set_off(&mut self, mask: u32) -> anyhow::Result<()> {
        self.control
            .set(0, mask, 0)
            .context("writing the BPF control map")
    }

    /// Counters summed over CPUs, by name, and (unless `ENGINESCOPE_BPF_STATS=0`) the time
    /// and runs of this sampler's programs as the kernel counted them, in all and per
    /// program (`bpf_prog_<name>_run_ns`, `bpf_prog_<name>_runs`).
    pub fn counters(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = abi::COUNTER_NAMES
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let v = self
                    .counters
                    .get(&(i as u32), 0)
                    .map(|per_cpu| per_cpu.iter().sum())
                    .unwrap_or(0);
                (name.to_string(), v)
            })
            .collect();
        if self.stats.is_some() {
            let (mut ns, mut runs) = (0u64, 0u64);
            for (name, prog) in self.bpf.programs() {
                if let Ok(info) = prog.info() {
                    let (n, r) = (info.run_time().as_nanos() as u64, info.run_count());
                    ns += n;
                    runs += r;
                    out.push((format!("bpf_prog_{name}_run_ns"), n));
                    out.push((format!("bpf_prog_{name}_runs"), r));
                }
            }
            out.push(("bpf_prog_run_ns".into(), ns));
            out.push(("bpf_prog_runs".into(), runs));
        }
        out.push(("gc_uprobe_links_closed_here".into(), self.closed_here));
        out.push(("sampling_rephases".into(), self.clock.rephases));
        out.push(("sampling_rephase_errors".into(), self.clock.rephase_errors));
        out
    }

    /// Give the sampling clock of each CPU whose turn has come a new period and phase
    /// (clock.rs); the recording loop calls it every turn.
    pub(crate) fn rephase_sampling(&mut self) {
        self.clock.rephase(crate::sys::monotonic_ns());
    }
}

/// Give `link` to the helper to close: its descriptor is found by link id among ours
/// (aya keeps the number private), sent, and our copy closed. The link back if it could not.
fn hand_over_link(
    c: &mut closer::UprobeCloser,
    link: aya::programs::uprobe::UProbeLink,
    fds: &std::collections::HashMap<u32, std::os::fd::RawFd>,
) -> Result<(), aya::programs::uprobe::UProbeLink> {
    use std::os::fd::BorrowedFd;
    let fd_link: aya::programs::links::FdLink = match link.try_into() {
        Ok(l) => l,
        // Not a bpf_link (kernels before 5.15 attach uprobes without one): the conversion
        // has closed it, here.
        Err(_) => return Ok(()),
    };
    let handed = fd_link
        .info()
        .ok()
        .and_then(|info| fds.get(&info.id()).copied())
        // SAFETY: the descriptor is `fd_link`'s, open until it drops below.
        .map(|fd| c.hand_over(unsafe { BorrowedFd::borrow_raw(fd) }));
    match handed {
        Some(Ok(())) => {
            drop(fd_link); // not the last close: the helper holds the link now
            Ok(())
        }
        // Back to the caller to close on a thread; a conversion that fails has closed it.
        _ => match aya::programs::uprobe::UProbeLink::try_from(fd_link) {
            Ok(link) => Err(link),
            Err(_) => Ok(()),
        },
    }
}

/// Our descriptors of BPF links by link id (the `link_id:` of their fdinfo).
fn link_fds() -> std::collections::HashMap<u32, std::os::fd::RawFd> {
    let mut out = std::collections::HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return out;
    };
    for e in dir.flatten() {
        // Only BPF links' fdinfo is read: reading every descriptor's (perf events, maps,
        // the recording) took seconds on a loaded machine, once per link.
        let is_link =
            std::fs::read_link(e.path()).is_ok_and(|t| t.as_os_str() == "anon_inode:bpf_link");
        if !is_link {
            continue;
        }
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")) else {
            continue;
        };
        if let Some(id) = info
            .lines()
            .find_map(|l| l.strip_prefix("link_id:"))
            .and_then(|v| v.trim().parse().ok())
        {
            out.insert(id, fd);
        }
    }
    out
}

/// The uprobes and uretprobes timing GC pauses in one interpreter binary.
#[derive(Default)]
pub(crate) struct GcUprobes {
    links: Vec<(&'static str, aya::programs::uprobe::UProbeLinkId)>,
}

/// What a thread holding write watchpoints pays per switch-in (and the switch-out that
/// follows) over one holding none, ns ([`BpfSampler::watched_switch_cost_ns`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwitchCost {
    /// Holding one watchpoint.
    pub one_ns: u64,
    /// Holding all four.
    pub four_ns: u64,
}

impl SwitchCost {
    /// Holding `regs` of them (between one and four, linearly; none costs nothing).
    pub(crate) fn with_regs(&self, regs: usize) -> u64 {
        match regs {
            0 => 0,
            r => {
                let r = r.min(4) as u64;
                self.one_ns + self.four_ns.saturating_sub(self.one_ns) * (r - 1) / 3
            }
        }
    }
}

/// A hardware write watchpoint on one thread with a BPF program on every hit: a perf event
/// of our own (`perf_event_open`, `PERF_TYPE_BREAKPOINT`) with the program set by
/// `PERF_EVENT_IOC_SET_BPF`. Dropping it closes the event, which frees the debug register
/// and the program's reference; so does our exit, however it happens.
///
/// Not aya's `PerfEvent::attach`: on kernels with BPF perf links it attaches through a
/// `bpf_link`, whose release the kernel defers, and the next `perf_event_open` of a breakpoint
/// then waits for it: 53 ms per watchpoint set on a loaded vLLM engine here, against 3 µs for
/// the same event with the program set by the ioctl (/tmp measurements with raw syscalls,
/// docs/probes.md). Register rotation and `--probe-budget` set and remove watchpoints many
/// times a second.
#[derive(Debug)]
pub struct Breakpoint {
    /// Held, not read: closing it (on drop) removes the watchpoint; or, for one set on every
    /// CPU, the slot it points (on drop it is disabled and the slot freed).
    _kind: BreakpointKind,
}

#[derive(Debug)]
enum BreakpointKind {
    Thread { _fd: std::os::fd::OwnedFd },
    Cpus { _held: CpuWatchHeld },
}

impl Breakpoint {
    /// Whether it is set on every CPU ([`BpfSampler::watch_refcount_cpus`]), not on one
    /// thread: the thread pays no debug-register reload at its context switches.
    pub(crate) fn on_every_cpu(&self) -> bool {
        matches!(self._kind, BreakpointKind::Cpus { .. })
    }
}

/// A slot of [`CpuSlot`]s in use by one watch: disabled, and free again, when dropped.
#[derive(Debug)]
struct CpuWatchHeld(std::sync::Arc<CpuSlot>);

impl Drop for CpuWatchHeld {
    fn drop(&mut self) {
        // A slot that cannot be disabled stays marked in use (never handed out again); its
        // events go when the sampler does.
        if self.0.point(None).is_ok() {
            self.0
                .in_use
                .store(false, std::sync::atomic::Ordering::Release);
        }
    }
}

/// One write watchpoint on every online CPU (`perf_event_open` with pid -1, one CPU each),
/// opened once, disabled, and pointed at a probed code object's reference count for one
/// on-phase at a time with `PERF_EVENT_IOC_MODIFY_ATTRIBUTES` (the kernel's debug-register
/// slots stay reserved, so re-pointing takes no lock and waits for no grace period: an IPI to
/// each CPU). A watchpoint held by a thread is written into the CPU's debug registers at every
/// switch into and out of that thread, which in a VM exits to the hypervisor: on a thread
/// that blocks and wakes across CPUs every ~80 µs (a pipe ping-pong, Intel VM), holding one
/// that never fired cost 8.7-9.7% of its throughput (armed/unarmed, 12-15 interleaved
/// pairs), and on a loaded vllm serve the worker ran 12% fewer steps while its probes were
/// watched (docs/probes.md); one set on the CPUs stays in their registers across switches
/// (the same ping-pong: 0.998). The price: any thread on any CPU that writes the address
/// traps while it is set (the BPF program drops threads of processes that are not targets;
/// other threads of the target are hits outside their watch, not timed), and each slot
/// reserves one debug register on every CPU while the recording lasts.
#[derive(Debug)]
struct CpuSlot {
    fds: Vec<std::os::fd::OwnedFd>,
    in_use: std::sync::atomic::AtomicBool,
}

/// Where a disabled [`CpuSlot`] points: an aligned user address no target writes.
const CPU_SLOT_PARKED: u64 = 0x1000;

/// Where a probe's watchpoint goes: its code object's reference count, or with
/// `ENGINESCOPE_PROBE_PARKED=1` (a measurement, never for use: nothing is timed) an address no
/// target writes, so that the watch's on-phases hold armed debug registers and make the same
/// settings but take no trap: what watching costs the target besides its traps.
fn probe_address(addr: u64) -> u64 {
    static PARKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *PARKED
        .get_or_init(|| std::env::var_os("ENGINESCOPE_PROBE_PARKED").is_some_and(|v| v == "1"))
    {
        CPU_SLOT_PARKED
    } else {
        addr
    }
}

impl CpuSlot {
    fn attr(addr: u64, enabled: bool) -> PerfEventAttr {
        let mut a = Breakpoint::attr(addr, 8);
        if !enabled {
            a.flags |= ATTR_DISABLED;
        }
        a
    }

    fn open(prog_fd: std::os::fd::RawFd, cpus: &[u32]) -> std::io::Result<CpuSlot> {
        let attr = Self::attr(CPU_SLOT_PARKED, false);
        let mut fds = Vec::with_capacity(cpus.len());
        for &cpu in cpus {
            let fd = perf_event_open_on(&attr, -1, cpu as i32)?;
            Breakpoint::set_bpf(&fd, prog_fd)?;
            fds.push(fd);
        }
        Ok(CpuSlot {
            fds,
            in_use: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Up to `n` slots, as many as the kernel gives (Err when it gives none: why).
    fn open_all(
        prog_fd: std::os::fd::RawFd,
        cpus: &[u32],
        n: usize,
    ) -> Result<Vec<CpuSlot>, String> {
        let mut out = Vec::new();
        for _ in 0..n {
            match Self::open(prog_fd, cpus) {
                Ok(s) => out.push(s),
                Err(e) if out.is_empty() => return Err(e.to_string()),
                Err(_) => break,
            }
        }
        Ok(out)
    }

    /// Point every CPU's event at `addr` and enable it, or (None) disable it.
    fn point(&self, addr: Option<u64>) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let attr = Self::attr(addr.unwrap_or(CPU_SLOT_PARKED), addr.is_some());
        for fd in &self.fds {
            // SAFETY: an ioctl on our own perf event descriptor that reads the attr we own.
            let rc = unsafe {
                libc::ioctl(
                    fd.as_raw_fd(),
                    PERF_EVENT_IOC_MODIFY_ATTRIBUTES as _,
                    &attr as *const PerfEventAttr,
                )
            };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("PERF_EVENT_IOC_MODIFY_ATTRIBUTES failed: {e}"),
                ));
            }
        }
        Ok(())
    }
}

/// A disabled software event (`PERF_COUNT_SW_DUMMY`) on this process, held while watchpoints
/// come and go. The kernel turns its context-switch hooks for per-thread perf events on when
/// the first such event is created and off a second after the last one is freed; turning
/// them on again waits for an RCU grace period inside `perf_event_open`. Under the probe
/// budget every watchpoint of an off-phase is removed, so each on-phase's first setting paid
/// that wait: 6 ms on a quiet machine, 0.55-0.82 s beside a loaded vllm serve (its worker's
/// settings: p99 550 ms, max 819 ms over 200; holding this event: max 136 µs, measured with
/// raw syscalls and the setter's kernel stack, `synchronize_rcu` under `perf_event_alloc`,
/// docs/probes.md). It counts nothing and is never enabled; closing it (on drop, or our exit)
/// lets the kernel turn the hooks off again.
struct SchedHooksHeld {
    _fd: std::os::fd::OwnedFd,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_DUMMY: u64 = 9;
/// `perf_event_attr.disabled` (bit 0 of the flags).
const ATTR_DISABLED: u64 = 1;

impl SchedHooksHeld {
    fn open() -> std::io::Result<SchedHooksHeld> {
        let attr = PerfEventAttr {
            type_: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: PERF_COUNT_SW_DUMMY,
            sample_period: 0,
            sample_type: 0,
            read_format: 0,
            flags: ATTR_DISABLED,
            wakeup_events: 0,
            bp_type: 0,
            bp_addr: 0,
            bp_len: 0,
            rest: [0; 7],
        };
        // pid 0, cpu -1: this thread, any CPU (a per-thread event, which is what keeps the
        // hooks on; a CPU-wide one would not).
        Ok(SchedHooksHeld {
            _fd: perf_event_open(&attr, 0)?,
        })
    }
}

/// `perf_event_open(attr, tid, -1, -1, FD_CLOEXEC)`.
fn perf_event_open(attr: &PerfEventAttr, tid: i32) -> std::io::Result<std::os::fd::OwnedFd> {
    perf_event_open_on(attr, tid, -1)
}

/// `perf_event_open(attr, tid, cpu, -1, FD_CLOEXEC)`.
fn perf_event_open_on(
    attr: &PerfEventAttr,
    tid: i32,
    cpu: i32,
) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: perf_event_open reads `size` bytes of the attr we own; pid/cpu/group are plain
    // values.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            attr as *const PerfEventAttr,
            tid as libc::pid_t,
            cpu as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(
            e.kind(),
            format!("perf_event_open failed: {e}"),
        ));
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// Sets and removes probe watchpoints on a helper thread, in the order they are asked for,
/// so that the recording loop does not wait in the kernel: it stamps a watch's end before it
/// hands the breakpoint over (hits after that are not timed) and does not wait for the close;
/// it waits for a setting (the watch's start and the seed read must follow the kernel's
/// install), which runs after the removals asked for before it (a rotation needs the register
/// an old one holds, and two events on one address would report each write twice).
///
/// The helper runs at the loop's priority (real-time when the loop is). At normal priority
/// beside a loaded vllm serve on 2 CPUs, a setting that takes ~100 µs in the kernel waited up
/// to 0.8 s on the run queue after its wake-up while the EngineCore ran on that CPU (the
/// kernel's `sched_wakeup` to `sched_switch`, measured with ftrace; enginescope and the engine
/// in different sessions' autogroups), and the loop waited with it: 0.9-1.8 s of watch
/// settings per 15 s recording, 0.3-1.4 s the longest. As a real-time thread, with
/// [`SchedHooksHeld`] open, 600 settings and removals on the loaded engine's threads took
/// 0.4 ms at most, with no retries spinning in the kernel.
struct Switcher {
    tx: std::sync::mpsc::Sender<SwitchJob>,
}

enum SwitchJob {
    Close(Breakpoint),
    Open {
        prog_fd: std::os::fd::RawFd,
        tid: i32,
        addr: u64,
        len: u64,
        reply: std::sync::mpsc::SyncSender<std::io::Result<Breakpoint>>,
    },
}

/// The longest the loop waits for a watchpoint to be set before it gives up on it (the
/// helper closes it when it comes).
const SET_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Switcher {
    fn spawn() -> std::io::Result<Switcher> {
        let (tx, rx) = std::sync::mpsc::channel::<SwitchJob>();
        // Threads start at normal priority (`SCHED_RESET_ON_FORK`); the loop that asks for
        // the first watchpoint says which this one runs at.
        let realtime = crate::sys::is_realtime_this_thread();
        std::thread::Builder::new()
            .name("es-watch".into())
            .spawn(move || {
                if !realtime || crate::sys::realtime_this_thread().is_err() {
                    crate::sys::normal_this_thread();
                }
                for job in rx {
                    match job {
                        SwitchJob::Close(w) => drop(w),
                        SwitchJob::Open {
                            prog_fd,
                            tid,
                            addr,
                            len,
                            reply,
                        } => {
                            // A reply nobody waits for any more drops the watchpoint: closed.
                            let _ = reply.send(Breakpoint::write_fd(prog_fd, tid, addr, len));
                        }
                    }
                }
            })?;
        Ok(Switcher { tx })
    }
}

/// `struct perf_event_attr` up to `bp_len` (`PERF_ATTR_SIZE_VER1`, 72 bytes), then zeros to
/// 128 bytes (fields the kernel takes as unset).
#[repr(C)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    bp_addr: u64,
    bp_len: u64,
    rest: [u64; 7],
}

/// Load BPF program `program` for the BTF tracepoint `tracepoint` and attach it.
fn attach_tp_btf(bpf: &mut Ebpf, program: &str, tracepoint: &str, btf: &Btf) -> anyhow::Result<()> {
    let prog: &mut BtfTracePoint = bpf
        .program_mut(program)
        .with_context(|| format!("BPF object has no {program} program"))?
        .try_into()?;
    prog.load(tracepoint, btf)
        .map_err(|e| anyhow!("verifier rejected {program}: {e:#}"))?;
    prog.attach()
        .with_context(|| format!("attaching to {tracepoint}"))?;
    Ok(())
}

const PERF_TYPE_BREAKPOINT: u32 = 5;
const HW_BREAKPOINT_W: u32 = 2;
/// A loaded perf-event program's descriptor (valid while it stays loaded).
fn raw_fd(prog: &PerfEvent) -> Result<std::os::fd::RawFd, aya::programs::ProgramError> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    Ok(prog.fd()?.as_fd().as_raw_fd())
}

const PERF_SAMPLE_RAW: u64 = 1 << 10;
/// `perf_event_attr.precise_ip` (bits 15-16) = 2, as aya sets for breakpoints.
const PRECISE_IP_2: u64 = 2 << 15;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// `_IOW('$', 8, __u32)`, `_IO('$', 0)`.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
/// `_IOW('$', 11, struct perf_event_attr *)`.
const PERF_EVENT_IOC_MODIFY_ATTRIBUTES: libc::c_ulong = 0x4008_240b;

impl Breakpoint {
    /// Watch writes of `len` bytes (1, 2, 4, 8) at `addr` in thread `tid`, running `prog`.
    fn write(prog: &PerfEvent, tid: i32, addr: u64, len: u64) -> std::io::Result<Breakpoint> {
        let prog_fd =
            raw_fd(prog).map_err(|e| std::io::Error::other(format!("program not loaded: {e}")))?;
        Self::write_fd(prog_fd, tid, addr, len)
    }

    /// As [`write`](Self::write), with the program's descriptor (valid while it is loaded).
    fn write_fd(
        prog_fd: std::os::fd::RawFd,
        tid: i32,
        addr: u64,
        len: u64,
    ) -> std::io::Result<Breakpoint> {
        let fd = perf_event_open(&Self::attr(addr, len), tid)?;
        Self::set_bpf(&fd, prog_fd)?;
        Ok(Breakpoint {
            _kind: BreakpointKind::Thread { _fd: fd },
        })
    }

    /// A write watchpoint of `len` bytes at `addr`, enabled from the start, sampling every
    /// hit with its raw record.
    fn attr(addr: u64, len: u64) -> PerfEventAttr {
        PerfEventAttr {
            type_: PERF_TYPE_BREAKPOINT,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: 0,
            sample_period: 1,
            sample_type: PERF_SAMPLE_RAW,
            read_format: 0,
            // Enabled from the start (bit 0, `disabled`, clear).
            flags: PRECISE_IP_2,
            wakeup_events: 1,
            bp_type: HW_BREAKPOINT_W,
            bp_addr: addr,
            bp_len: len,
            rest: [0; 7],
        }
    }

    /// Run `prog_fd` on every hit of the event `fd` and enable it.
    fn set_bpf(fd: &std::os::fd::OwnedFd, prog_fd: std::os::fd::RawFd) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        for (req, arg, what) in [
            (
                PERF_EVENT_IOC_SET_BPF,
                prog_fd as libc::c_ulong,
                "PERF_EVENT_IOC_SET_BPF",
            ),
            (PERF_EVENT_IOC_ENABLE, 0, "PERF_EVENT_IOC_ENABLE"),
        ] {
            // SAFETY: ioctls on our own perf event descriptor with an integer argument.
            if unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg) } != 0 {
                let e = std::io::Error::last_os_error();
                return Err(std::io::Error::new(e.kind(), format!("{what} failed: {e}")));
            }
        }
        Ok(())
    }
}

/// A program error with the OS error behind it (aya's `SyscallError` shows only the call).
fn os_error(e: &aya::programs::ProgramError) -> String {
    match e {
        aya::programs::ProgramError::SyscallError(s) => {
            format!("{} failed: {}", s.call, s.io_error)
        }
        other => other.to_string(),
    }
}
