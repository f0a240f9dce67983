//! A process's modules: which are mapped where, their symbol tables loaded off the drain thread
//! (`SymbolLoader`), shared between processes of one file (`ModuleCache`).

use super::*;

/// A module mapped in one process.
pub(super) struct Mapped {
    range: Range<u64>,
    pub(super) bias: u64,
    pub(super) module: Arc<ElfModule>,
}

/// One process's modules and unwinder.
pub struct ProcessNative {
    pid: i32,
    maps_text: String,
    mapped: Vec<Mapped>,
    unwinder: UnwinderX86_64<Section>,
    cache: CacheX86_64,
    last_refresh: std::time::Instant,
    /// Modules that could not be opened (path → why), reported once in counters.
    pub unreadable: HashMap<String, String>,
}

/// How long symbol tables took to read, for the counters.
#[derive(Default)]
pub struct LoadStats {
    pub loads: std::sync::atomic::AtomicU64,
    pub total_ns: std::sync::atomic::AtomicU64,
    pub max_ns: std::sync::atomic::AtomicU64,
    /// The loader thread's id (0 until it runs), for [`SymbolLoader::hurry`].
    pub(super) tid: std::sync::atomic::AtomicI32,
    /// Whether the loader was put back at the default priority (counter
    /// `native_symbol_loader_hurried`).
    pub hurried: std::sync::atomic::AtomicBool,
}

/// Reads modules' symbol tables on a thread of its own (one, at a lower CPU priority), so
/// that the thread draining the ring buffer never waits for a large library's table: each
/// module is queued once, when a sample first has a frame in it (a process maps hundreds of
/// libraries, most never sampled: reading all of them at attach would cost seconds of CPU).
/// On a machine whose CPUs the target keeps busy, nice 10 can starve it (libtorch's table took
/// 26 s at a load average of 10 on 2 CPUs, and events waiting for it overflowed their bound):
/// [`SymbolLoader::hurry`] puts it back at the default priority once events pile up.
pub struct SymbolLoader {
    tx: std::sync::mpsc::Sender<Arc<ElfModule>>,
    thread: std::thread::JoinHandle<()>,
    pub stats: Arc<LoadStats>,
}

impl SymbolLoader {
    /// Start the thread; `None` when it cannot be started (symbols are then read on demand).
    pub fn spawn() -> Option<Self> {
        use std::sync::atomic::Ordering::Relaxed;
        let (tx, rx) = std::sync::mpsc::channel::<Arc<ElfModule>>();
        let stats = Arc::new(LoadStats::default());
        let st = stats.clone();
        let thread = std::thread::Builder::new()
            .name("es-symbols".into())
            .spawn(move || {
                // SAFETY: plain syscalls on this thread's own id; a failure leaves the
                // default priority.
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, 10);
                    st.tid.store(tid as i32, Relaxed);
                }
                // Ends when the sender is dropped (the recording's native state goes).
                for m in rx {
                    if m.symbols_ready() {
                        continue;
                    }
                    let t = std::time::Instant::now();
                    m.load_symbols();
                    let ns = t.elapsed().as_nanos() as u64;
                    st.loads.fetch_add(1, Relaxed);
                    st.total_ns.fetch_add(ns, Relaxed);
                    st.max_ns.fetch_max(ns, Relaxed);
                }
            })
            .ok()?;
        Some(SymbolLoader { tx, thread, stats })
    }

    /// Put the loader at the calling thread's priority (once): events are waiting for it.
    pub(crate) fn hurry(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let tid = self.stats.tid.load(Relaxed);
        if tid <= 0 || self.stats.hurried.swap(true, Relaxed) {
            return;
        }
        // SAFETY: getpriority(2)/setpriority(2) on threads of this process; a failure (no
        // CAP_SYS_NICE to lower a nice value) leaves the loader at nice 10.
        unsafe {
            let me = libc::syscall(libc::SYS_gettid) as libc::id_t;
            let nice = libc::getpriority(libc::PRIO_PROCESS, me);
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice.min(10));
        }
    }

    /// Stop taking modules, wait for the queued ones to be read, and return the figures.
    pub fn close(self) -> Arc<LoadStats> {
        drop(self.tx);
        let _ = self.thread.join();
        self.stats
    }

    /// Queue a module whose symbols are not read yet (once).
    pub(super) fn submit(&self, m: &Arc<ElfModule>) {
        if m.symbols_ready() || m.queued.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        // A closed channel (thread gone) leaves the module to be read on demand.
        let _ = self.tx.send(m.clone());
    }
}

/// ELF modules shared between processes, by (device, inode), and the loader that reads their
/// symbols in the background (none: read on first use, on the caller's thread).
#[derive(Default)]
pub struct ModuleCache {
    pub(super) modules: HashMap<(u64, u64), Arc<ElfModule>>,
    pub loader: Option<SymbolLoader>,
}

impl ProcessNative {
    pub fn new(pid: i32, cache: &mut ModuleCache) -> Self {
        let mut p = ProcessNative {
            pid,
            maps_text: String::new(),
            mapped: Vec::new(),
            unwinder: UnwinderX86_64::new(),
            cache: CacheX86_64::new(),
            last_refresh: std::time::Instant::now(),
            unreadable: HashMap::new(),
        };
        p.refresh(cache);
        p
    }

    /// Re-read `/proc/PID/maps` and add new executable mappings (dlopen'ed extensions). New
    /// modules are only mapped and indexed here (no symbol table is read).
    pub(crate) fn refresh(&mut self, cache: &mut ModuleCache) {
        self.last_refresh = std::time::Instant::now();
        let Ok(text) = std::fs::read_to_string(format!("/proc/{}/maps", self.pid)) else {
            return;
        };
        if text == self.maps_text {
            return;
        }
        let root = format!("/proc/{}/root", self.pid);
        let mut mapped = Vec::new();
        for m in crate::cpython::binary::parse_maps(&text) {
            if !m.perms.contains('x') || !m.path.starts_with('/') {
                continue;
            }
            let mf = format!("/proc/{}/map_files/{:x}-{:x}", self.pid, m.start, m.end);
            let file = match std::fs::File::open(&mf) {
                Ok(f) => f,
                Err(e) => {
                    self.unreadable.insert(m.path.clone(), e.to_string());
                    continue;
                }
            };
            let key = {
                use std::os::unix::fs::MetadataExt;
                match file.metadata() {
                    Ok(md) => (md.dev(), md.ino()),
                    Err(_) => continue,
                }
            };
            let module = match cache.modules.get(&key) {
                Some(m) => m.clone(),
                None => match ElfModule::open(&file, &m.path, &root) {
                    Ok(em) => {
                        let em = Arc::new(em);
                        cache.modules.insert(key, em.clone());
                        em
                    }
                    Err(e) => {
                        self.unreadable.insert(m.path.clone(), e.to_string());
                        continue;
                    }
                },
            };
            let bias = module.bias(m.start, m.offset);
            mapped.push(Mapped {
                range: m.start..m.end,
                bias,
                module,
            });
        }
        mapped.sort_by_key(|m| m.range.start);
        let mut unwinder = UnwinderX86_64::new();
        for m in &mapped {
            unwinder.add_module(Module::new(
                m.module.path.clone(),
                m.range.clone(),
                m.bias,
                m.module.unwind_info(),
            ));
        }
        self.unwinder = unwinder;
        self.mapped = mapped;
        self.maps_text = text;
    }

    pub(super) fn mapping(&self, avma: u64) -> Option<&Mapped> {
        let i = self.mapped.partition_point(|m| m.range.start <= avma);
        let m = self.mapped.get(i.checked_sub(1)?)?;
        (avma < m.range.end).then_some(m)
    }

    /// Unwind the user stack from the copied window `stack` (the bytes from `sp` up).
    pub(crate) fn unwind(
        &mut self,
        cache: &mut ModuleCache,
        ip: u64,
        sp: u64,
        bp: u64,
        stack: &[u8],
    ) -> Walked {
        if ip == 0 {
            return Walked {
                frames: Vec::new(),
                complete: false,
                used: 0,
                past_end: false,
            };
        }
        let due = |p: &Self| p.last_refresh.elapsed().as_millis() > 200;
        if self.mapping(ip).is_none() && due(self) {
            // An address in no known module: a library loaded since the last look.
            self.refresh(cache);
        }
        let walked = self.walk(ip, sp, bp, stack);
        // A return address in no known module (a library loaded since the process was
        // mapped, met further out than the leaf): look again and walk again, once.
        if !walked.complete
            && due(self)
            && walked
                .frames
                .iter()
                .any(|f| self.mapping(f.address_for_lookup()).is_none())
        {
            self.refresh(cache);
            return self.walk(ip, sp, bp, stack);
        }
        walked
    }

    fn walk(&mut self, ip: u64, sp: u64, bp: u64, stack: &[u8]) -> Walked {
        let mut out = Vec::new();
        // The deepest byte of the window the unwind read, and whether it wanted one past it.
        let mut used = 0usize;
        let mut past_end = false;
        let mut read = |addr: u64| -> Result<u64, ()> {
            let off = addr.checked_sub(sp).ok_or(())? as usize;
            let end = off.checked_add(8).ok_or(())?;
            let Some(b) = stack.get(off..end) else {
                if off < USTACK_WINDOW_MAX {
                    past_end = true;
                }
                return Err(());
            };
            used = used.max(end);
            Ok(u64::from_le_bytes(b.try_into().map_err(|_| ())?))
        };
        let regs = UnwindRegsX86_64::new(ip, sp, bp);
        let mut it = self
            .unwinder
            .iter_frames(ip, regs, &mut self.cache, &mut read);
        let mut complete = false;
        // Bounded: a 16 KiB window holds at most 2048 return addresses.
        for _ in 0..512 {
            match it.next() {
                Ok(Some(f)) => out.push(f),
                Ok(None) => {
                    complete = true;
                    break;
                }
                Err(_) => break,
            }
        }
        Walked {
            frames: out,
            complete,
            used,
            past_end,
        }
    }

    /// One user address, not yet named: its module and address in the module's file.
    pub(crate) fn raw_frame(&self, addr: FrameAddress) -> RawFrame {
        let look = addr.address_for_lookup();
        RawFrame {
            addr: look,
            module: self
                .mapping(look)
                .map(|m| (m.module.clone(), look.wrapping_sub(m.bias))),
        }
    }

    /// Name one user address now (reading its module's symbols if need be): (frame, info,
    /// whether it is the evaluation loop).
    pub fn frame(&self, addr: FrameAddress) -> (Frame, NativeFrameInfo, bool) {
        name_frame(&self.raw_frame(addr), true)
    }
}
