//! Native (C/C++) and kernel frames for BPF samples (`record --native`, `--kernel-stacks`).
//!
//! The kernel side sends, with each sample and blocking switch-out of a target thread, a
//! `NATIVE_STACK` record: the kernel stack (return addresses from `bpf_get_stack`, unwound by
//! the kernel's ORC unwinder), the user registers (ip, sp, bp) and a window of up to 16 KiB of
//! the user stack from sp. Here, without touching the target:
//!
//! * kernel addresses are named from `/proc/kallsyms` ([`KernelSymbols`]);
//! * the user stack is unwound with `framehop` from each module's `.eh_frame` (libpython and
//!   most distribution libraries have no frame pointers), over the copied bytes only;
//! * each user address is named from the module's `.symtab`, else `.dynsym`, else a separate
//!   debug file found by build-id (`/usr/lib/debug/.build-id/xx/rest.debug`, in the target's
//!   root too), and C++ names are demangled;
//! * the native frames are merged with the Python frames the kernel walked ([`merge`]): each
//!   evaluation-loop frame (`_PyEval_EvalFrameDefault`) stands for the run of Python frames
//!   one C-level call of the loop executes (the kernel marks where those runs start).
//!
//! Module files are opened through `/proc/PID/map_files/` (the target's own file whatever its
//! mount namespace or chroot) and memory-mapped; only the symbol tables and unwind sections are
//! read. Everything read from the target or its files is untrusted: lookups are bounded and
//! failures give fewer frames, never an error that stops recording.

pub mod backlog;
pub mod builtins;
pub mod merge;

use std::collections::HashMap;
use std::ops::{Deref, Range};
use std::sync::Arc;

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder};
use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

use crate::cpython::Frame;
use crate::record::{NativeFrameInfo, FRAME_KERNEL, FRAME_NATIVE};

/// What `record` asks the kernel for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NativeOptions {
    /// Kernel stacks on samples and blocking switch-outs.
    pub kernel: bool,
    /// User registers and stack window: native frames unwound in user space.
    pub user: bool,
}

impl NativeOptions {
    pub fn any(&self) -> bool {
        self.kernel || self.user
    }
}

/// `/proc/kallsyms`, sorted, text symbols only.
pub struct KernelSymbols {
    /// (address, name's range in `names`), sorted by address.
    syms: Vec<(u64, u32, u32)>,
    names: String,
}

impl KernelSymbols {
    /// Read `/proc/kallsyms`; empty (every kernel frame `[kernel]`) when unreadable or when
    /// addresses are hidden (kptr_restrict).
    pub fn load() -> Self {
        let text = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        Self::parse(&text)
    }

    /// An empty table (kernel frames are not named).
    pub fn empty() -> Self {
        KernelSymbols {
            syms: Vec::new(),
            names: String::new(),
        }
    }

    /// Parse kallsyms text (`ADDR TYPE NAME [MODULE]` lines). Read at every start with kernel
    /// stacks (~120,000 lines here), so by hand, with the names in one string. The
    /// `__pfx_` padding symbols (16 bytes before each function, never executed) are left
    /// out: half the lines.
    pub fn parse(text: &str) -> Self {
        let mut syms = Vec::with_capacity(text.len() / 48);
        let mut names = String::with_capacity(text.len() / 3);
        let sep = |c: char| c == ' ' || c == '\t';
        for l in text.split('\n') {
            // `ADDR T NAME`: the type is the one byte between the first two spaces.
            let Some((addr, rest)) = l.split_once(' ') else {
                continue;
            };
            if !matches!(rest.as_bytes(), [b't' | b'T' | b'w' | b'W', b' ', ..]) {
                continue;
            }
            let name = rest[2..].split(sep).next().unwrap_or("");
            if name.is_empty() || name.starts_with("__pfx_") {
                continue;
            }
            let Ok(addr) = u64::from_str_radix(addr.trim(), 16) else {
                continue;
            };
            let (Ok(start), Ok(len)) = (u32::try_from(names.len()), u32::try_from(name.len()))
            else {
                break;
            };
            if addr == 0 {
                continue;
            }
            names.push_str(name);
            syms.push((addr, start, len));
        }
        syms.sort_unstable_by_key(|s| s.0);
        syms.dedup_by_key(|s| s.0);
        KernelSymbols { syms, names }
    }

    pub fn is_empty(&self) -> bool {
        self.syms.is_empty()
    }

    /// The symbol containing `addr` and its start address.
    pub fn lookup(&self, addr: u64) -> Option<(u64, &str)> {
        let i = self.syms.partition_point(|s| s.0 <= addr);
        let &(start, from, len) = self.syms.get(i.checked_sub(1)?)?;
        // Past the last text symbol is not kernel text we can name.
        if i == self.syms.len() && addr - start > 1 << 20 {
            return None;
        }
        let name = self
            .names
            .get(from as usize..from as usize + len as usize)
            .unwrap_or("");
        Some((start, name))
    }

    /// A kernel frame for a return address (the call is the byte before it) or the IP.
    pub fn frame(&self, addr: u64, is_return: bool) -> (Frame, NativeFrameInfo) {
        let look = if is_return {
            addr.saturating_sub(1)
        } else {
            addr
        };
        let (start, name) = match self.lookup(look) {
            Some((s, n)) => (s, n.to_string()),
            None => (0, format!("0x{addr:x}")),
        };
        (
            Frame {
                function: name,
                file: KERNEL_MODULE.to_string(),
                line: None,
            },
            NativeFrameInfo {
                kind: FRAME_KERNEL,
                addr: start,
                module: KERNEL_MODULE.to_string(),
                build_id: String::new(),
            },
        )
    }
}

/// The function name of code with no symbol (a stripped library's local functions).
pub const NO_SYMBOL: &str = "<no symbol>";

/// The module name kernel frames carry.
pub const KERNEL_MODULE: &str = "[kernel.kallsyms]";

/// Bytes of a mapped module section.
#[derive(Clone)]
pub struct Section {
    map: Arc<memmap2::Mmap>,
    range: Range<usize>,
}

impl Deref for Section {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map.get(self.range.clone()).unwrap_or(&[])
    }
}

/// One ELF file's symbols and unwind sections.
pub struct ElfModule {
    /// Path as the target maps it.
    pub path: String,
    pub build_id: String,
    map: Arc<memmap2::Mmap>,
    /// The target's root directory (`/proc/PID/root`), for a separate debug file.
    root: String,
    /// The symbol table, read on first need ([`ElfModule::load_symbols`]): off the thread
    /// that drains the ring buffer, by [`SymbolLoader`], since a large library's table
    /// (libtorch_cpu: ~10^6 symbols) takes seconds to read.
    syms: std::sync::OnceLock<ModuleSymbols>,
    /// Queued to the loader already (once per module).
    queued: std::sync::atomic::AtomicBool,
    sections: HashMap<&'static str, (Range<u64>, Range<usize>)>,
    /// Executable PT_LOAD segments: (file offset, vaddr, filesz).
    loads: Vec<(u64, u64, u64)>,
    /// Functions named from the interpreter's own state ([`crate::cpython::builtins`]: the
    /// C function behind `pickle.dumps` is `_pickle.dumps`), by start svma, for code with no
    /// symbol; `None`: two names claim the address.
    builtins: std::sync::RwLock<HashMap<u64, Option<Arc<str>>>>,
    /// Function starts (svma) listed in `.eh_frame_hdr`, sorted: read when a builtin is
    /// first added.
    fde_starts: std::sync::OnceLock<Vec<u64>>,
}

/// Bumped whenever a module gains a builtin name: caches of named frames are then stale.
static BUILTINS_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The current [`BUILTINS_GENERATION`].
pub fn builtins_generation() -> u64 {
    BUILTINS_GENERATION.load(std::sync::atomic::Ordering::Relaxed)
}

/// One module's symbols, read from its file.
pub struct ModuleSymbols {
    /// Function symbols sorted by address: (start svma, size, name).
    symbols: Vec<(u64, u64, Arc<str>)>,
    /// Where the symbols came from: `symtab`, `dynsym`, `debug file`, or `none`.
    pub source: &'static str,
    /// Address ranges (svma) of the evaluation loop (its hot and `.cold` parts), when this is
    /// the interpreter core.
    pub eval_ranges: Vec<Range<u64>>,
}

const UNWIND_SECTIONS: [&str; 5] = [
    ".text",
    ".eh_frame",
    ".eh_frame_hdr",
    ".debug_frame",
    ".got",
];

/// Strip GCC's clone suffixes (`save.lto_priv.0`, `foo.cold`, `bar.isra.0`) from C names.
fn clean_c_name(name: &str) -> &str {
    match name.find('.') {
        Some(i) if i > 0 => &name[..i],
        _ => name,
    }
}

fn demangle(name: &str) -> String {
    // Rust (legacy `_ZN…17h<hash>E` and v0 `_R…`), e.g. tokenizers; `{:#}` drops the hash.
    if let Ok(d) = rustc_demangle::try_demangle(name) {
        return format!("{d:#}");
    }
    if name.starts_with("_Z") {
        if let Ok(sym) = cpp_demangle::Symbol::new(name) {
            let opts = cpp_demangle::DemangleOptions::new()
                .no_params()
                .no_return_type();
            if let Ok(s) = sym.demangle_with_options(&opts) {
                return s;
            }
        }
        return name.to_string();
    }
    clean_c_name(name).to_string()
}

fn read_symbols(file: &object::File<'_>, dynamic: bool) -> Vec<(u64, u64, Arc<str>)> {
    let iter: Box<dyn Iterator<Item = object::Symbol<'_, '_>>> = if dynamic {
        Box::new(file.dynamic_symbols())
    } else {
        Box::new(file.symbols())
    };
    iter.filter(|s| s.kind() == SymbolKind::Text && s.address() != 0 && s.is_definition())
        .filter_map(|s| {
            let name = s.name().ok()?;
            if name.is_empty() {
                return None;
            }
            // Raw names: demangled when first looked up (libtorch_cpu has ~10^5 symbols).
            Some((s.address(), s.size(), Arc::from(name)))
        })
        .collect()
}

impl ElfModule {
    /// Map `file` (opened by the caller), mapped in the target as `path`, and index its
    /// unwind sections; cheap (section and program headers only): the symbol table is read
    /// later ([`ElfModule::load_symbols`]). `root` is the target's root directory
    /// (`/proc/PID/root`) for debug files.
    pub fn open(file: &std::fs::File, path: &str, root: &str) -> anyhow::Result<ElfModule> {
        // SAFETY: the file is opened read-only and mapped privately; a library replaced on
        // disk while mapped would change bytes under us, which the parsers treat as untrusted
        // input (bounds-checked), so the worst outcome is a wrong name, not memory unsafety
        // beyond what `memmap2` documents for files truncated concurrently (SIGBUS), which
        // does not happen to loaded shared objects (the loader holds them).
        let map = Arc::new(unsafe { memmap2::Mmap::map(file)? });
        let obj = object::File::parse(&map[..])?;
        let build_id = obj
            .build_id()
            .ok()
            .flatten()
            .map(|b| b.iter().map(|x| format!("{x:02x}")).collect::<String>())
            .unwrap_or_default();
        let mut sections = HashMap::new();
        for name in UNWIND_SECTIONS {
            if let Some(s) = obj.section_by_name(name) {
                if let Some((off, size)) = s.file_range() {
                    let (Ok(off), Ok(size)) = (usize::try_from(off), usize::try_from(size)) else {
                        continue;
                    };
                    if off.checked_add(size).is_some_and(|e| e <= map.len()) {
                        sections
                            .insert(name, (s.address()..s.address() + s.size(), off..off + size));
                    }
                }
            }
        }
        let loads = match &obj {
            object::File::Elf64(elf) => {
                use object::read::elf::ProgramHeader;
                let e = elf.endian();
                elf.elf_program_headers()
                    .iter()
                    .filter(|p| {
                        p.p_type(e) == object::elf::PT_LOAD && p.p_flags(e) & object::elf::PF_X != 0
                    })
                    .map(|p| (p.p_offset(e), p.p_vaddr(e), p.p_filesz(e)))
                    .collect()
            }
            _ => Vec::new(),
        };
        Ok(ElfModule {
            path: path.to_string(),
            build_id,
            map,
            root: root.to_string(),
            syms: std::sync::OnceLock::new(),
            queued: std::sync::atomic::AtomicBool::new(false),
            sections,
            loads,
            builtins: std::sync::RwLock::new(HashMap::new()),
            fde_starts: std::sync::OnceLock::new(),
        })
    }

    fn fde_starts(&self) -> &[u64] {
        self.fde_starts.get_or_init(|| {
            self.sections
                .get(".eh_frame_hdr")
                .and_then(|(svma, range)| fde_table(self.map.get(range.clone())?, svma.start))
                .unwrap_or_default()
        })
    }

    /// Name the function starting at `svma` from the interpreter's state (`None`: the
    /// address is ambiguous). Only function starts that `.eh_frame_hdr` lists are taken (a
    /// wrong address read from the target names nothing). Whether anything changed.
    pub fn add_builtin(&self, svma: u64, name: Option<&str>) -> bool {
        if self.fde_starts().binary_search(&svma).is_err() {
            return false;
        }
        let Ok(mut b) = self.builtins.write() else {
            return false;
        };
        let new = name.map(Arc::<str>::from);
        match b.get(&svma) {
            Some(old) if *old == new => return false,
            Some(None) => return false,
            Some(Some(_)) => {
                b.insert(svma, None);
            }
            None => {
                if b.len() >= crate::cpython::builtins::MAX_FUNCTIONS {
                    return false;
                }
                b.insert(svma, new);
            }
        }
        BUILTINS_GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// The builtin named for the function containing `svma`: (start, name).
    pub fn builtin(&self, svma: u64) -> Option<(u64, Arc<str>)> {
        let b = self.builtins.read().ok()?;
        if b.is_empty() {
            return None;
        }
        let starts = self.fde_starts();
        let start = *starts.get(starts.partition_point(|&s| s <= svma).checked_sub(1)?)?;
        b.get(&start)?.as_ref().map(|n| (start, n.clone()))
    }

    /// The function containing `svma`: its symbol, else its builtin name.
    pub fn function(&self, svma: u64) -> Option<(u64, Arc<str>)> {
        match self.symbol(svma) {
            Some((s, n)) => Some((s, n.clone())),
            None => self.builtin(svma),
        }
    }

    /// Whether the symbol table has been read (naming this module's frames will not wait).
    pub fn symbols_ready(&self) -> bool {
        self.syms.get().is_some()
    }

    /// The symbol table, read now if nobody has (a caller racing the loader waits for it).
    pub fn load_symbols(&self) -> &ModuleSymbols {
        self.syms.get_or_init(|| self.read_symbol_table())
    }

    fn read_symbol_table(&self) -> ModuleSymbols {
        let Ok(obj) = object::File::parse(&self.map[..]) else {
            return ModuleSymbols {
                symbols: Vec::new(),
                source: "none",
                eval_ranges: Vec::new(),
            };
        };
        let build_id = &self.build_id;
        let root = &self.root;
        let mut symbols = read_symbols(&obj, false);
        let mut source = "symtab";
        if symbols.is_empty() && build_id.len() > 2 {
            // A separate debug file by build-id, in the target's root first.
            for base in [
                format!("{root}/usr/lib/debug"),
                "/usr/lib/debug".to_string(),
            ] {
                let p = format!(
                    "{base}/.build-id/{}/{}.debug",
                    &build_id[..2],
                    &build_id[2..]
                );
                if let Ok(f) = std::fs::File::open(&p) {
                    // SAFETY: as in `open`.
                    if let Ok(m) = unsafe { memmap2::Mmap::map(&f) } {
                        if let Ok(dbg) = object::File::parse(&m[..]) {
                            symbols = read_symbols(&dbg, false);
                            if !symbols.is_empty() {
                                source = "debug file";
                                break;
                            }
                        }
                    }
                }
            }
        }
        if symbols.is_empty() {
            symbols = read_symbols(&obj, true);
            source = "dynsym";
        }
        if symbols.is_empty() {
            source = "none";
        }
        symbols.sort_unstable_by_key(|s| s.0);
        let mut eval_ranges: Vec<Range<u64>> = symbols
            .iter()
            .filter(|s| clean_c_name(&s.2) == "_PyEval_EvalFrameDefault")
            .map(|s| s.0..s.0 + s.1.max(1))
            .collect();
        if !eval_ranges.is_empty() && source == "dynsym" {
            // A stripped interpreter (Debian's static python3.X): the exported symbol is a
            // small entry part; a PGO/LTO build moves the loop's body to a separate, unnamed
            // code range. It is the largest function in the binary by far (75-85 KiB against
            // < 40 KiB for any other in 3.13-3.15), so take the largest .eh_frame_hdr entry.
            if let Some((svma, range)) = self.sections.get(".eh_frame_hdr") {
                if let Some(r) = self
                    .map
                    .get(range.clone())
                    .and_then(|b| largest_fde(b, svma.start))
                {
                    eval_ranges.push(r);
                }
            }
        }
        ModuleSymbols {
            symbols,
            source,
            eval_ranges,
        }
    }

    /// The function containing `svma`: (start, name). Reads the symbol table if not yet read.
    pub fn symbol(&self, svma: u64) -> Option<(u64, &Arc<str>)> {
        let symbols = &self.load_symbols().symbols;
        let i = symbols.partition_point(|s| s.0 <= svma);
        let (start, size, name) = symbols.get(i.checked_sub(1)?)?;
        // Sized symbols must contain the address; unsized ones reach to the next symbol.
        if *size > 0 && svma >= start + size {
            return None;
        }
        Some((*start, name))
    }

    /// The load bias for a mapping of this file at `map_start` with file offset `offset`.
    fn bias(&self, map_start: u64, offset: u64) -> u64 {
        // The mapping starts at the page holding the segment's first byte: compare with the
        // segment's page-aligned offset, and work from its vaddr at that alignment.
        for &(off, vaddr, filesz) in &self.loads {
            let page_off = off & !0xfff;
            if offset >= page_off && offset < off + filesz.max(1) {
                let page_vaddr = vaddr.wrapping_sub(off - page_off);
                return map_start.wrapping_sub(page_vaddr + (offset - page_off));
            }
        }
        map_start.wrapping_sub(offset)
    }

    fn section(&self, name: &str) -> Option<(Range<u64>, Section)> {
        let (svma, range) = self.sections.get(name)?.clone();
        Some((
            svma,
            Section {
                map: self.map.clone(),
                range,
            },
        ))
    }

    fn unwind_info(&self) -> ExplicitModuleSectionInfo<Section> {
        let text = self.section(".text");
        let eh = self.section(".eh_frame");
        let hdr = self.section(".eh_frame_hdr");
        ExplicitModuleSectionInfo {
            base_svma: 0,
            text_svma: text.as_ref().map(|t| t.0.clone()),
            text: text.map(|t| t.1),
            got_svma: self.section(".got").map(|g| g.0),
            eh_frame_svma: eh.as_ref().map(|t| t.0.clone()),
            eh_frame: eh.map(|t| t.1),
            eh_frame_hdr_svma: hdr.as_ref().map(|t| t.0.clone()),
            eh_frame_hdr: hdr.map(|t| t.1),
            debug_frame: self.section(".debug_frame").map(|t| t.1),
            stubs_svma: None,
            stub_helper_svma: None,
            unwind_info: None,
            text_segment_svma: None,
            text_segment: None,
        }
    }

    /// Short display name: `_pickle` for `_pickle.cpython-311-x86_64-linux-gnu.so`,
    /// `libtorch_cpu` for `libtorch_cpu.so`, `python3.13` for the executable.
    pub fn short_name(&self) -> String {
        short_module_name(&self.path)
    }
}

/// The largest function (address range, svma) listed in an `.eh_frame_hdr` search table,
/// measured as the distance to the next entry. Only the encodings every x86-64 toolchain
/// writes are read (pcrel sdata4 pointer, udata4 count, datarel sdata4 table); else `None`.
pub fn largest_fde(hdr: &[u8], hdr_svma: u64) -> Option<Range<u64>> {
    fde_table(hdr, hdr_svma)?
        .windows(2)
        .map(|w| w[0]..w[1])
        .max_by_key(|r| r.end - r.start)
}

/// The function starts (svma) an `.eh_frame_hdr` search table lists, sorted (the encodings
/// of [`largest_fde`]).
fn fde_table(hdr: &[u8], hdr_svma: u64) -> Option<Vec<u64>> {
    let (&version, &ptr_enc, &count_enc, &table_enc) =
        (hdr.first()?, hdr.get(1)?, hdr.get(2)?, hdr.get(3)?);
    if version != 1 || ptr_enc != 0x1b || count_enc != 0x03 || table_enc != 0x3b {
        return None;
    }
    let count = u32::from_le_bytes(hdr.get(8..12)?.try_into().ok()?) as usize;
    let table = hdr.get(12..12 + count.checked_mul(8)?)?;
    let mut starts: Vec<u64> = table
        .chunks_exact(8)
        .map(|e| {
            let rel = i32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            hdr_svma.wrapping_add_signed(rel as i64)
        })
        .collect();
    starts.sort_unstable();
    starts.dedup();
    Some(starts)
}

/// `_pickle.cpython-311-x86_64-linux-gnu.so` → `_pickle`; `libc.so.6` → `libc`.
pub fn short_module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let base = base.split(".cpython-").next().unwrap_or(base);
    let base = base.split(".so").next().unwrap_or(base);
    let base = base.split(".abi3").next().unwrap_or(base);
    base.to_string()
}

/// A module mapped in one process.
struct Mapped {
    range: Range<u64>,
    bias: u64,
    module: Arc<ElfModule>,
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
    tid: std::sync::atomic::AtomicI32,
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
    pub fn hurry(&self) {
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
    fn submit(&self, m: &Arc<ElfModule>) {
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
    modules: HashMap<(u64, u64), Arc<ElfModule>>,
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
    pub fn refresh(&mut self, cache: &mut ModuleCache) {
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

    fn mapping(&self, avma: u64) -> Option<&Mapped> {
        let i = self.mapped.partition_point(|m| m.range.start <= avma);
        let m = self.mapped.get(i.checked_sub(1)?)?;
        (avma < m.range.end).then_some(m)
    }

    /// Unwind the user stack from the copied window `stack` (the bytes from `sp` up).
    pub fn unwind(
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
    pub fn raw_frame(&self, addr: FrameAddress) -> RawFrame {
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

    /// Whether any module has a known evaluation loop (mixed stacks can be merged); reads
    /// the symbol tables not yet read.
    pub fn has_eval_loop(&self) -> bool {
        self.mapped
            .iter()
            .any(|m| !m.module.load_symbols().eval_ranges.is_empty())
    }
}

/// The largest user stack window the kernel side copies (`ES_USTACK_MAX`).
pub const USTACK_WINDOW_MAX: usize = crate::bpf::abi::USTACK_MAX;

/// One user stack unwind.
pub struct Walked {
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
    module: Option<(Arc<ElfModule>, u64)>,
}

impl RawFrame {
    /// Whether naming it will not wait for a symbol table.
    pub fn ready(&self) -> bool {
        self.module.as_ref().is_none_or(|(m, _)| m.symbols_ready())
    }
}

/// The function name given a frame whose module's symbols were still being read when it had
/// to be written (a backlog over its bound).
pub const SYMBOLS_NOT_LOADED: &str = "<symbols not loaded>";

/// Name a raw frame: (frame, info, whether it is the evaluation loop). With `wait` false, a
/// module whose symbols are not read yet gives [`SYMBOLS_NOT_LOADED`] instead of waiting.
fn name_frame(raw: &RawFrame, wait: bool) -> (Frame, NativeFrameInfo, bool) {
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
    pub fn unwind_raw(&mut self, pid: i32, rec: &crate::bpf::abi::NativeStack<'_>) -> RawNative {
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

    pub fn forget(&mut self, pid: i32) {
        self.procs.remove(&pid);
        if let Some(b) = &self.builtins {
            b.forget(pid);
        }
    }

    /// Have the builtin functions of `pid`'s interpreter `interp` named (offsets `o`).
    pub fn watch_builtins(&mut self, pid: i32, o: &crate::cpython::offsets::Offsets, interp: u64) {
        if let Some(b) = &self.builtins {
            b.watch(pid, o.clone(), interp);
        }
    }

    /// Give the modules the builtin names read since the last call.
    pub fn apply_builtins(&mut self) {
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
    pub fn hurry_symbols(&self) {
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

/// Split the entry marks off raw frames (clearing the bit so offsets are offsets again). On
/// 3.10 (`minor`) every frame is its own evaluation-loop call.
pub fn entry_marks(frames: &mut [crate::bpf::abi::EsFrame], minor: u8) -> Vec<bool> {
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
pub struct NativeState {
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
struct ThreadWindow {
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
const WINDOW_EPOCH: u32 = 256;

/// The window (0 = all) for unwinds that read at most `peak` bytes: half as much again and
/// 256 bytes more, in whole KiB.
pub fn window_for(peak: usize) -> u32 {
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
    fn observe(&mut self, used: usize, copied: usize, past_end: bool) -> Option<u32> {
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
    pub fn take_window_changes(&mut self) -> Vec<(i32, u32)> {
        std::mem::take(&mut self.window_changes)
    }

    /// The window thread `tid` has now (0 = all), for a thread entry written afresh.
    pub fn window_of(&self, tid: i32) -> u32 {
        self.windows.get(&tid).map_or(0, |w| w.set)
    }

    /// A thread gone: forget its window.
    pub fn thread_gone(&mut self, tid: i32) {
        self.windows.remove(&tid);
    }

    /// Unwind a NATIVE_STACK record of process `pid` straight from the ring buffer and keep
    /// it until its event arrives.
    pub fn stash(&mut self, pid: i32, bytes: &[u8]) {
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
    pub fn mixed(
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
    pub fn mixed_stack(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_windows() {
        assert_eq!(window_for(0), 1024);
        assert_eq!(window_for(800), 2048);
        assert_eq!(window_for(1300), 3072);
        assert_eq!(window_for(11_000), 0, "all of it");
        let mut w = ThreadWindow::default();
        // A thread starts with all 16 KiB; its first unwind sizes the window.
        assert_eq!(w.observe(900, USTACK_WINDOW_MAX, false), Some(2048));
        assert_eq!(w.observe(700, 2048, false), None);
        // Deeper for once: ran past the 2 KiB copied, so the next ones are sized for 4 KiB.
        assert_eq!(w.observe(2048, 2048, true), Some(7168));
        // The peak is kept for one to two epochs, then the window shrinks back.
        let mut last = None;
        for _ in 0..2 * WINDOW_EPOCH {
            if let Some(s) = w.observe(900, 7168, false) {
                last = Some(s);
            }
        }
        assert_eq!(last, Some(2048));
    }

    #[test]
    fn kallsyms_lookup() {
        let k = KernelSymbols::parse(
            "ffffffff81000000 T _stext\nffffffff81001000 t futex_wait\n0000000000000000 T hidden\nffffffff81002000 D data\nffffffff81002ff0 t __pfx_do_epoll_wait\nffffffff81003000 T do_epoll_wait\nffffffff81004000 t mod_fn\t[kvm]\n",
        );
        assert_eq!(k.lookup(0xffffffff81004001).unwrap().1, "mod_fn");
        assert_eq!(
            k.lookup(0xffffffff81002ff8).unwrap().1,
            "futex_wait",
            "padding symbols are left out"
        );
        assert_eq!(k.lookup(0xffffffff81001010).unwrap().1, "futex_wait");
        assert_eq!(k.lookup(0xffffffff81002010).unwrap().1, "futex_wait");
        assert_eq!(k.lookup(0xffffffff81003000).unwrap().1, "do_epoll_wait");
        assert!(k.lookup(0x1000).is_none());
        let (f, i) = k.frame(0xffffffff81001001, true);
        assert_eq!(f.function, "futex_wait");
        assert_eq!(i.kind, FRAME_KERNEL);
        let (f, _) = k.frame(0xffffffff81001000, true);
        assert_eq!(
            f.function, "_stext",
            "a return address names the call before it"
        );
    }

    #[test]
    fn module_names() {
        assert_eq!(
            short_module_name("/x/_pickle.cpython-311-x86_64-linux-gnu.so"),
            "_pickle"
        );
        assert_eq!(short_module_name("/lib/x86_64-linux-gnu/libc.so.6"), "libc");
        assert_eq!(short_module_name("/usr/bin/python3.13"), "python3.13");
        assert_eq!(
            short_module_name("/x/libpython3.11.so.1.0"),
            "libpython3.11"
        );
        assert_eq!(clean_c_name("save.lto_priv.0"), "save");
        assert_eq!(demangle("_ZN2at6native3addEv"), "at::native::add");
        assert_eq!(
            demangle("_RNvNtNtNtNtNtCsjrHSEGnQ3l9_3std3sys3pal4unix14stack_overflow11thread_info16set_current_info"),
            "std::sys::pal::unix::stack_overflow::thread_info::set_current_info"
        );
    }

    /// Name a function of this test binary from its address, through the same module table
    /// (maps, map_files, load bias, .symtab) the recorder uses for a target.
    #[test]
    fn names_own_function() {
        #[inline(never)]
        fn es_marker_function(x: u64) -> u64 {
            std::hint::black_box(x.wrapping_mul(31))
        }
        let addr = es_marker_function as *const () as u64;
        std::hint::black_box(es_marker_function(1));
        let mut cache = ModuleCache::default();
        let p = ProcessNative::new(std::process::id() as i32, &mut cache);
        let (f, info, eval) = p.frame(FrameAddress::from_instruction_pointer(addr + 1));
        assert!(f.function.contains("es_marker_function"), "{f:?} {info:?}");
        assert_eq!(info.kind, FRAME_NATIVE);
        assert!(!eval);
    }

    /// Mapping a process reads no symbol table: a frame unwound before its module's symbols
    /// are read stays raw (module, address) and is named once they are, the same as at once.
    #[test]
    fn raw_frames_wait_for_symbols() {
        #[inline(never)]
        fn es_marker_later(x: u64) -> u64 {
            std::hint::black_box(x.wrapping_mul(37))
        }
        let addr = es_marker_later as *const () as u64;
        std::hint::black_box(es_marker_later(1));
        let mut cache = ModuleCache::default();
        let p = ProcessNative::new(std::process::id() as i32, &mut cache);
        let raw = RawNative {
            kernel: Vec::new(),
            user: vec![p.raw_frame(FrameAddress::from_instruction_pointer(addr))],
            complete: true,
            ..RawNative::default()
        };
        assert!(!raw.ready(), "no symbol table is read when mapping");
        let mut native = Native::new(NativeOptions::default());
        let early = native.name(&raw, false);
        assert_eq!(early.user[0].0.function, SYMBOLS_NOT_LOADED);
        assert_eq!(native.unnamed_not_loaded, 1);
        // Read (what the loader thread does), then named without waiting.
        if let Some((m, _)) = &raw.user[0].module {
            m.load_symbols();
        }
        assert!(raw.ready());
        let named = native.name(&raw, false);
        assert!(
            named.user[0].0.function.contains("es_marker_later"),
            "{:?}",
            named.user[0]
        );
        // Raw: the address itself; named: its function's start, in the same module.
        assert!(named.user[0].1.addr <= early.user[0].1.addr);
        assert_eq!(named.user[0].1.module, early.user[0].1.module);
        assert_eq!(native.unnamed_not_loaded, 1);
    }

    /// The loader thread reads the symbols of each module queued to it, once each.
    #[test]
    fn loader_reads_symbols() {
        let mut cache = ModuleCache {
            modules: HashMap::new(),
            loader: SymbolLoader::spawn(),
        };
        let _p = ProcessNative::new(std::process::id() as i32, &mut cache);
        assert!(!cache.modules.is_empty());
        assert!(
            cache.modules.values().all(|m| !m.symbols_ready()),
            "mapping reads no symbol table"
        );
        let loader = cache.loader.take().expect("loader thread");
        for m in cache.modules.values() {
            loader.submit(m);
            loader.submit(m);
        }
        // Hurried: at this thread's priority (lowering a nice value takes root).
        loader.hurry();
        let tid = loader.stats.tid.load(std::sync::atomic::Ordering::Relaxed);
        // SAFETY: geteuid/gettid/getpriority of this process's threads.
        unsafe {
            if tid > 0 && libc::geteuid() == 0 {
                let me = libc::syscall(libc::SYS_gettid) as libc::id_t;
                assert_eq!(
                    libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t),
                    libc::getpriority(libc::PRIO_PROCESS, me).min(10),
                    "the loader runs at the caller's priority once hurried"
                );
            }
        }
        // Closing waits for the queue to be worked off.
        let stats = loader.close();
        assert_eq!(
            stats.loads.load(std::sync::atomic::Ordering::Relaxed),
            cache.modules.len() as u64
        );
        assert!(cache.modules.values().all(|m| m.symbols_ready()));
    }
}
