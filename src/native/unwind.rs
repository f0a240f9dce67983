//! One native stack: the user stack window unwound from `.eh_frame` and each frame named.

use super::*;

/// The largest user stack window the kernel side copies (`ES_USTACK_MAX`).
pub(crate) const USTACK_WINDOW_MAX: usize = crate::bpf::abi::USTACK_MAX;

/// One user stack unwind.
pub(crate) struct Walked {
    /// Addresses innermost first (the IP, then return addresses).
    pub frames: Vec<FrameAddress>,
    /// The unwind reached the stack's root.
    pub complete: bool,
    /// Bytes of the window the unwind read (up to the deepest word).
    pub used: usize,
    /// It stopped wanting a word past the end of the window (a larger one would go on).
    pub past_end: bool,
}

/// A user frame unwound but not yet named: the address (for lookup: a return address less
/// one), and the module mapped there with the address in the module's own address space.
#[derive(Clone)]
pub struct RawFrame {
    pub addr: u64,
    pub(super) module: Option<(Arc<ElfModule>, u64)>,
}

impl RawFrame {
    /// Whether naming it will not wait for a symbol table.
    pub fn ready(&self) -> bool {
        self.module.as_ref().is_none_or(|(m, _)| m.symbols_ready())
    }
}

/// The function name given a frame whose module's symbols were still being read when it had
/// to be written (a backlog over its bound).
pub(crate) const SYMBOLS_NOT_LOADED: &str = "<symbols not loaded>";

/// Name a raw frame: (frame, info, whether it is the evaluation loop). With `wait` false, a
/// module whose symbols are not read yet gives [`SYMBOLS_NOT_LOADED`] instead of waiting.
pub(super) fn name_frame(raw: &RawFrame, wait: bool) -> (Frame, NativeFrameInfo, bool) {
    let look = raw.addr;
    match &raw.module {
        Some((module, svma)) => {
            let svma = *svma;
            let syms = match module.syms.get() {
                Some(s) => Some(s),
                None if wait => Some(module.load_symbols()),
                None => None,
            };
            let (start, function, is_eval) = match syms {
                Some(syms) => {
                    let is_eval = syms.eval_ranges.iter().any(|r| r.contains(&svma));
                    // Code with no symbol (a stripped library's local functions): one frame
                    // per module, so that it adds up in a flamegraph; the address stays in
                    // the info.
                    match module.symbol(svma) {
                        Some((s, n)) => (s, demangle(n), is_eval),
                        None => match module.builtin(svma) {
                            Some((s, n)) => (s, n.to_string(), is_eval),
                            None => (svma, NO_SYMBOL.to_string(), is_eval),
                        },
                    }
                }
                None => (svma, SYMBOLS_NOT_LOADED.to_string(), false),
            };
            (
                Frame {
                    function,
                    file: module.path.clone(),
                    line: None,
                },
                NativeFrameInfo {
                    kind: FRAME_NATIVE,
                    addr: start,
                    module: module.path.clone(),
                    build_id: module.build_id.clone(),
                },
                is_eval,
            )
        }
        None => (
            Frame {
                function: format!("0x{look:x}"),
                file: "[unknown]".to_string(),
                line: None,
            },
            NativeFrameInfo {
                kind: FRAME_NATIVE,
                addr: look,
                module: "[unknown]".to_string(),
                build_id: String::new(),
            },
            false,
        ),
    }
}

/// One native stack, unwound but not yet named (its modules' symbols may still be loading):
/// kernel return addresses and user frames, innermost first.
#[derive(Clone, Default)]
pub struct RawNative {
    pub kernel: Vec<u64>,
    pub user: Vec<RawFrame>,
    pub complete: bool,
    /// Bytes of the stack window the unwind read, and whether it wanted more than was copied.
    pub used: usize,
    pub past_end: bool,
}

impl RawNative {
    /// Whether every user frame can be named without waiting.
    pub fn ready(&self) -> bool {
        self.user.iter().all(RawFrame::ready)
    }
}

/// One native stack, resolved: frames innermost first, each with whether it is an
/// evaluation-loop frame.
#[derive(Debug, Clone, Default)]
pub struct NativeFrames {
    pub kernel: Vec<(Frame, NativeFrameInfo)>,
    pub user: Vec<(Frame, NativeFrameInfo, bool)>,
    /// The user unwind reached the root (else it stopped at the window's end or an error).
    pub complete: bool,
}

/// Kernel and user space symbolization state for a recording.
pub struct Native {
    pub opts: NativeOptions,
    pub kernel: KernelSymbols,
    pub modules: ModuleCache,
    pub procs: HashMap<i32, ProcessNative>,
    /// Named user frames by (module, address in it): a module stays in [`ModuleCache`] for
    /// the recording's life, so its address is a stable key.
    names: HashMap<(usize, u64), (Frame, NativeFrameInfo, bool)>,
    /// [`builtins_generation`] when `names` was last cleared for it.
    names_generation: u64,
    /// Reads the interpreters' builtin function names (`None` without user stacks).
    builtins: Option<builtins::BuiltinReader>,
    /// Builtin names given to modules, and scans that failed.
    pub builtins_named: u64,
    /// Health counters (`native_*`).
    pub unwound: u64,
    pub unwind_incomplete: u64,
    /// Unwinds that stopped wanting stack beyond the copied window.
    pub unwind_past_window: u64,
    /// User stack bytes copied by the kernel, and read by the unwinds, in all.
    pub window_bytes: u64,
    pub window_used_bytes: u64,
    pub merged: u64,
    pub merge_fallback: u64,
    /// User frames written as [`SYMBOLS_NOT_LOADED`].
    pub unnamed_not_loaded: u64,
}

impl Native {
    pub fn new(opts: NativeOptions) -> Self {
        Native {
            opts,
            kernel: if opts.kernel {
                KernelSymbols::load()
            } else {
                KernelSymbols::empty()
            },
            modules: ModuleCache {
                modules: HashMap::new(),
                loader: if opts.user {
                    SymbolLoader::spawn()
                } else {
                    None
                },
            },
            procs: HashMap::new(),
            names: HashMap::new(),
            names_generation: 0,
            builtins: if opts.user {
                builtins::BuiltinReader::spawn()
            } else {
                None
            },
            builtins_named: 0,
            unwound: 0,
            unwind_incomplete: 0,
            unwind_past_window: 0,
            window_bytes: 0,
            window_used_bytes: 0,
            merged: 0,
            merge_fallback: 0,
            unnamed_not_loaded: 0,
        }
    }

    /// Map a process's modules now (at attach): the first samples need not wait for it.
    pub fn attach(&mut self, pid: i32) {
        if self.opts.user {
            let modules = &mut self.modules;
            self.procs
                .entry(pid)
                .or_insert_with(|| ProcessNative::new(pid, modules));
        }
    }

    /// Unwind one NATIVE_STACK record of process `pid` (no symbol table is read here).
    pub(crate) fn unwind_raw(
        &mut self,
        pid: i32,
        rec: &crate::bpf::abi::NativeStack<'_>,
    ) -> RawNative {
        let mut out = RawNative {
            kernel: rec.kernel().collect(),
            ..RawNative::default()
        };
        if self.opts.user && rec.ip != 0 {
            let modules = &mut self.modules;
            let p = self
                .procs
                .entry(pid)
                .or_insert_with(|| ProcessNative::new(pid, modules));
            let w = p.unwind(modules, rec.ip, rec.sp, rec.bp, rec.stack);
            out.complete = w.complete;
            out.used = w.used;
            out.past_end = w.past_end;
            self.unwound += 1;
            if !w.complete {
                self.unwind_incomplete += 1;
                if w.past_end {
                    self.unwind_past_window += 1;
                }
            }
            self.window_bytes += rec.stack.len() as u64;
            self.window_used_bytes += w.used as u64;
            out.user = w.frames.into_iter().map(|a| p.raw_frame(a)).collect();
            if let Some(l) = &modules.loader {
                for f in &out.user {
                    if let Some((m, _)) = &f.module {
                        l.submit(m);
                    }
                }
            }
        }
        out
    }

    /// Name a raw stack's user frames; `wait`: read symbol tables not yet read (else those
    /// frames are [`SYMBOLS_NOT_LOADED`]).
    pub fn name(&mut self, raw: &RawNative, wait: bool) -> NativeFrames {
        let generation = builtins_generation();
        if generation != self.names_generation {
            self.names.clear();
            self.names_generation = generation;
        }
        let mut user = Vec::with_capacity(raw.user.len());
        for f in &raw.user {
            let key = f
                .module
                .as_ref()
                .map(|(m, svma)| (Arc::as_ptr(m) as usize, *svma));
            if let Some(hit) = key.and_then(|k| self.names.get(&k)) {
                user.push(hit.clone());
                continue;
            }
            let ready = f.ready();
            let named = name_frame(f, wait);
            if !ready && !wait {
                self.unnamed_not_loaded += 1;
            } else if let Some(k) = key {
                if self.names.len() > 1 << 18 {
                    self.names.clear();
                }
                self.names.insert(k, named.clone());
            }
            user.push(named);
        }
        NativeFrames {
            kernel: raw
                .kernel
                .iter()
                .enumerate()
                .map(|(i, &a)| self.kernel.frame(a, i > 0))
                .collect(),
            user,
            complete: raw.complete,
        }
    }

    /// Resolve one NATIVE_STACK record of process `pid` now (reading symbols if need be).
    pub fn resolve(&mut self, pid: i32, rec: &crate::bpf::abi::NativeStack<'_>) -> NativeFrames {
        let raw = self.unwind_raw(pid, rec);
        self.name(&raw, true)
    }

    pub(crate) fn forget(&mut self, pid: i32) {
        self.procs.remove(&pid);
        if let Some(b) = &self.builtins {
            b.forget(pid);
        }
    }

    /// Have the builtin functions of `pid`'s interpreter `interp` named (offsets `o`).
    pub(crate) fn watch_builtins(
        &mut self,
        pid: i32,
        o: &crate::cpython::offsets::Offsets,
        interp: u64,
    ) {
        if let Some(b) = &self.builtins {
            b.watch(pid, o.clone(), interp);
        }
    }

    /// Give the modules the builtin names read since the last call.
    pub(crate) fn apply_builtins(&mut self) {
        let Some(batches) = self.builtins.as_ref().map(|r| r.take()) else {
            return;
        };
        for (pid, names) in batches {
            let modules = &mut self.modules;
            let Some(p) = self.procs.get_mut(&pid) else {
                continue;
            };
            let mut refreshed = false;
            for (addr, name) in names {
                if p.mapping(addr).is_none() && !refreshed {
                    // A module loaded after the last read of the maps.
                    p.refresh(modules);
                    refreshed = true;
                }
                if let Some(m) = p.mapping(addr) {
                    if m.module
                        .add_builtin(addr.wrapping_sub(m.bias), name.as_deref())
                    {
                        self.builtins_named += 1;
                    }
                }
            }
        }
    }

    /// Events are piling up behind symbol tables: let the loader run at the drain's priority.
    pub(crate) fn hurry_symbols(&self) {
        if let Some(l) = &self.modules.loader {
            l.hurry();
        }
    }

    pub fn counters(&self, c: &mut std::collections::BTreeMap<String, u64>) {
        use std::sync::atomic::Ordering::Relaxed;
        c.insert("native_unwound".into(), self.unwound);
        c.insert("native_unwind_incomplete".into(), self.unwind_incomplete);
        c.insert("native_unwind_past_window".into(), self.unwind_past_window);
        c.insert("native_window_bytes".into(), self.window_bytes);
        c.insert("native_window_used_bytes".into(), self.window_used_bytes);
        c.insert("native_merged".into(), self.merged);
        c.insert("native_merge_fallback".into(), self.merge_fallback);
        let unreadable: usize = self.procs.values().map(|p| p.unreadable.len()).sum();
        c.insert("native_unreadable_modules".into(), unreadable as u64);
        c.insert(
            "native_frames_symbols_not_loaded".into(),
            self.unnamed_not_loaded,
        );
        c.insert("native_builtins_named".into(), self.builtins_named);
        if let Some(b) = &self.builtins {
            b.counters(c);
        }
        if let Some(l) = &self.modules.loader {
            let s = &l.stats;
            c.insert("native_symbol_loads".into(), s.loads.load(Relaxed));
            c.insert(
                "native_symbol_load_total_ms".into(),
                s.total_ns.load(Relaxed) / 1_000_000,
            );
            c.insert(
                "native_symbol_load_max_ms".into(),
                s.max_ns.load(Relaxed) / 1_000_000,
            );
            c.insert(
                "native_symbol_loader_hurried".into(),
                s.hurried.load(Relaxed) as u64,
            );
        }
    }
}
