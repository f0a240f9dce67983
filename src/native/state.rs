//! The per-recording native state: each thread's stack window, the functions and mixed
//! stacks already named, and the kernel's entry marks that tie native frames to Python ones.

use super::*;

/// Split the entry marks off raw frames (clearing the bit so offsets are offsets again). On
/// 3.10 (`minor`) every frame is its own evaluation-loop call.
pub(crate) fn entry_marks(frames: &mut [crate::bpf::abi::EsFrame], minor: u8) -> Vec<bool> {
    if minor <= 10 {
        return vec![true; frames.len()];
    }
    frames
        .iter_mut()
        .map(|f| {
            let e = f.instr_offset >= 0 && f.instr_offset & crate::bpf::abi::FRAME_ENTRY != 0;
            if e {
                f.instr_offset &= !crate::bpf::abi::FRAME_ENTRY;
            }
            e
        })
        .collect()
}

/// The recorder's native state: symbolization plus the NATIVE_STACK records waiting for the
/// sample or switch-out they belong to (the next record of the same thread, same time).
pub(crate) struct NativeState {
    pub native: Native,
    /// Unwound records by thread, with their time.
    pending: HashMap<i32, (u64, RawNative)>,
    pub unpaired: u64,
    /// Mixed stacks already written, by what they were made from ([`mixed_key`]), within
    /// writer generation `mixed_generation`: a stack seen before is neither named, merged
    /// nor interned again.
    mixed: HashMap<Vec<u64>, (u32, merge::MergeKind)>,
    mixed_generation: u64,
    /// [`builtins_generation`] of `mixed` and `functions`.
    builtins_generation: u64,
    key: Vec<u64>,
    pub mixed_hits: u64,
    /// The function (start; `u64::MAX`: none) containing a user address and whether it is
    /// the evaluation loop, by (module, address in it): a symbol table's binary search misses
    /// the cache at each step, a few per frame.
    functions: HashMap<(usize, u64), (u64, bool)>,
    /// The user stack window of each thread, and the changes the kernel has yet to be told.
    windows: HashMap<i32, ThreadWindow>,
    window_changes: Vec<(i32, u32)>,
}

/// How much of a thread's user stack the kernel copies: 1.5 times the most its unwinds read
/// over the last one to two [`WINDOW_EPOCH`]s of records ([`window_for`]); after an unwind
/// that wanted more than was copied (that sample loses its outermost native frames), sized
/// for twice the copy. The first record of a thread copies all 16 KiB. Most stacks need 1-2
/// KiB, and the copy (in the kernel, then through the ring buffer) was most of what a native
/// stack cost.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ThreadWindow {
    /// What the kernel copies now (0 = all).
    set: u32,
    peak: usize,
    prev_peak: usize,
    n: u32,
}

/// Threads whose window is remembered at most (then forgotten all at once: each starts over
/// at its current window, re-sent only when it changes).
const WINDOWS_MAX: usize = 1 << 15;

/// Records per epoch of [`ThreadWindow`].
pub(super) const WINDOW_EPOCH: u32 = 256;

/// The window (0 = all) for unwinds that read at most `peak` bytes: half as much again and
/// 256 bytes more, in whole KiB.
pub(crate) fn window_for(peak: usize) -> u32 {
    let w = peak
        .saturating_add(peak / 2)
        .saturating_add(256)
        .div_ceil(1024)
        .saturating_mul(1024);
    if w >= USTACK_WINDOW_MAX {
        0
    } else {
        w as u32
    }
}

impl ThreadWindow {
    /// Account one unwind that read `used` bytes of the `copied`; `past_end`: it wanted
    /// more (the next windows are sized for twice what was copied).
    pub(super) fn observe(&mut self, used: usize, copied: usize, past_end: bool) -> Option<u32> {
        let need = if past_end {
            copied.saturating_mul(2).max(used)
        } else {
            used
        };
        self.peak = self.peak.max(need);
        self.n += 1;
        if self.n >= WINDOW_EPOCH {
            self.prev_peak = self.peak;
            self.peak = 0;
            self.n = 0;
        }
        let want = window_for(self.peak.max(self.prev_peak));
        (want != self.set).then(|| {
            self.set = want;
            want
        })
    }
}

/// User addresses whose function is remembered at most (then forgotten all at once).
const FUNCTIONS_MAX: usize = 1 << 18;

/// Distinct mixed stacks remembered at most (then forgotten all at once; each is a few hundred
/// bytes).
const MIXED_CACHE_MAX: usize = 1 << 16;

impl NativeState {
    pub fn new(opts: NativeOptions) -> Self {
        NativeState {
            native: Native::new(opts),
            pending: HashMap::new(),
            unpaired: 0,
            mixed: HashMap::new(),
            mixed_generation: 0,
            builtins_generation: 0,
            key: Vec::new(),
            mixed_hits: 0,
            functions: HashMap::new(),
            windows: HashMap::new(),
            window_changes: Vec::new(),
        }
    }

    /// Window changes for the kernel: (tid, bytes of user stack to copy, 0 = all).
    pub(crate) fn take_window_changes(&mut self) -> Vec<(i32, u32)> {
        std::mem::take(&mut self.window_changes)
    }

    /// The window thread `tid` has now (0 = all), for a thread entry written afresh.
    pub(crate) fn window_of(&self, tid: i32) -> u32 {
        self.windows.get(&tid).map_or(0, |w| w.set)
    }

    /// A thread gone: forget its window.
    pub(crate) fn thread_gone(&mut self, tid: i32) {
        self.windows.remove(&tid);
    }

    /// Unwind a NATIVE_STACK record of process `pid` straight from the ring buffer and keep
    /// it until its event arrives.
    pub(crate) fn stash(&mut self, pid: i32, bytes: &[u8]) {
        if let Some(n) = crate::bpf::abi::parse_native(bytes) {
            let raw = self.native.unwind_raw(pid, &n);
            if self.native.opts.user && n.ip != 0 {
                let tid = n.tid as i32;
                // Bounded: threads without a Python thread state (not in the kernel's thread
                // map, so never told a window) are never reported gone.
                if self.windows.len() >= WINDOWS_MAX && !self.windows.contains_key(&tid) {
                    self.windows.clear();
                }
                let w = self.windows.entry(tid).or_default();
                if let Some(set) = w.observe(raw.used, n.stack.len(), raw.past_end) {
                    self.window_changes.push((tid, set));
                }
            }
            if self
                .pending
                .insert(n.tid as i32, (n.time_ns, raw))
                .is_some()
            {
                self.unpaired += 1;
            }
        }
    }

    /// The native record sent with an event of `tid` at `time_ns`, unwound (None: no
    /// native record for it). Called as the event is drained: records pair in order.
    pub fn take(&mut self, tid: i32, time_ns: u64) -> Option<RawNative> {
        let (t, raw) = self.pending.remove(&tid)?;
        if t != time_ns {
            self.unpaired += 1;
            return None;
        }
        Some(raw)
    }

    /// The merged stack of an event: its Python frames (`python`, with their entry marks)
    /// and its native record named (`wait`: reading symbol tables not yet read).
    pub(crate) fn mixed(
        &mut self,
        raw: &RawNative,
        python: &[Frame],
        entry: &[bool],
        wait: bool,
    ) -> merge::Mixed {
        let frames = self.native.name(raw, wait);
        let (m, kind) = merge::merge(python, entry, &frames);
        self.count_merge(kind);
        m
    }

    fn count_merge(&mut self, kind: merge::MergeKind) {
        match kind {
            merge::MergeKind::Exact => self.native.merged += 1,
            merge::MergeKind::Partial | merge::MergeKind::LeafOnly => {
                self.native.merge_fallback += 1
            }
            merge::MergeKind::NativeOnly => {}
        }
    }

    /// The id in `writer` of the merged stack of an event (as [`Self::mixed`], interned). A
    /// stack made from the same Python frames, entry marks, kernel functions and user
    /// addresses as one written before gets that one's id without being named again.
    pub(crate) fn mixed_stack(
        &mut self,
        writer: &mut crate::record::format::RecordingWriter,
        raw: &RawNative,
        python: &[Frame],
        entry: &[bool],
        wait: bool,
    ) -> anyhow::Result<u32> {
        // Names are final only once every module's symbols are read.
        let cacheable = raw.ready();
        if cacheable {
            if self.mixed_generation != writer.generation() {
                self.mixed.clear();
                self.mixed_generation = writer.generation();
            }
            let generation = builtins_generation();
            if generation != self.builtins_generation {
                // Functions with no symbol may have a name now.
                self.mixed.clear();
                self.functions.clear();
                self.builtins_generation = generation;
            }
            let mut key = std::mem::take(&mut self.key);
            key.clear();
            key.push(python.len() as u64);
            for (i, f) in python.iter().enumerate() {
                let e = entry.get(i).copied().unwrap_or(false) as u64;
                key.push(u64::from(writer.frame_id(f)?) << 1 | e);
            }
            key.push(raw.kernel.len() as u64);
            for (i, &a) in raw.kernel.iter().enumerate() {
                // The function, not the return address: the same stack from other call sites.
                let look = if i > 0 { a.saturating_sub(1) } else { a };
                match self.native.kernel.lookup(look) {
                    Some((start, _)) => key.push(start),
                    None => key.extend([0, a]),
                }
            }
            key.push(raw.user.len() as u64);
            for f in &raw.user {
                // What naming reads: the module, the function containing the address (the
                // same for every address in it; none: one `<no symbol>` frame per module)
                // and whether it is the evaluation loop.
                match &f.module {
                    Some((m, svma)) => {
                        let ptr = Arc::as_ptr(m) as usize;
                        let (start, is_eval) = match self.functions.get(&(ptr, *svma)) {
                            Some(&v) => v,
                            None => {
                                let is_eval = m
                                    .load_symbols()
                                    .eval_ranges
                                    .iter()
                                    .any(|r| r.contains(svma));
                                let start = m.function(*svma).map_or(u64::MAX, |(s, _)| s);
                                if self.functions.len() >= FUNCTIONS_MAX {
                                    self.functions.clear();
                                }
                                self.functions.insert((ptr, *svma), (start, is_eval));
                                (start, is_eval)
                            }
                        };
                        key.extend([ptr as u64, start, is_eval as u64]);
                    }
                    None => key.extend([0, f.addr, 0]),
                }
            }
            if let Some(&(id, kind)) = self.mixed.get(&key) {
                self.mixed_hits += 1;
                self.count_merge(kind);
                self.key = key;
                return Ok(id);
            }
            let frames = self.native.name(raw, wait);
            let (m, kind) = merge::merge(python, entry, &frames);
            self.count_merge(kind);
            let id = writer.intern_mixed(&m)?;
            if self.mixed.len() >= MIXED_CACHE_MAX {
                self.mixed.clear();
            }
            self.mixed.insert(key.clone(), (id, kind));
            self.key = key;
            return Ok(id);
        }
        let m = self.mixed(raw, python, entry, wait);
        writer.intern_mixed(&m)
    }

    pub fn counters(&self, c: &mut std::collections::BTreeMap<String, u64>) {
        self.native.counters(c);
        c.insert("native_unpaired".into(), self.unpaired);
        c.insert("native_mixed_cache_hits".into(), self.mixed_hits);
    }
}
