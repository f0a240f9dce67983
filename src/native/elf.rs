//! A module's ELF file: its symbols (`.symtab`, `.dynsym`, a debug file by build-id), C++ names
//! demangled, and the unwind sections `framehop` reads.

use super::*;

/// The function name of code with no symbol (a stripped library's local functions).
pub(crate) const NO_SYMBOL: &str = "<no symbol>";

/// The module name kernel frames carry.
pub(crate) const KERNEL_MODULE: &str = "[kernel.kallsyms]";

/// Bytes of a mapped module section.
#[derive(Clone)]
pub(crate) struct Section {
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
pub(crate) struct ElfModule {
    /// Path as the target maps it.
    pub path: String,
    pub build_id: String,
    map: Arc<memmap2::Mmap>,
    /// The target's root directory (`/proc/PID/root`), for a separate debug file.
    root: String,
    /// The symbol table, read on first need ([`ElfModule::load_symbols`]): off the thread
    /// that drains the ring buffer, by [`SymbolLoader`], since a large library's table
    /// (libtorch_cpu: ~10^6 symbols) takes seconds to read.
    pub(super) syms: std::sync::OnceLock<ModuleSymbols>,
    /// Queued to the loader already (once per module).
    pub(super) queued: std::sync::atomic::AtomicBool,
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
pub(crate) fn builtins_generation() -> u64 {
    BUILTINS_GENERATION.load(std::sync::atomic::Ordering::Relaxed)
}

/// One module's symbols, read from its file.
pub(crate) struct ModuleSymbols {
    /// Function symbols sorted by address: (start svma, size, name).
    symbols: Vec<(u64, u64, Arc<str>)>,
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
pub(super) fn clean_c_name(name: &str) -> &str {
    match name.find('.') {
        Some(i) if i > 0 => &name[..i],
        _ => name,
    }
}

pub(super) fn demangle(name: &str) -> String {
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
    pub(crate) fn add_builtin(&self, svma: u64, name: Option<&str>) -> bool {
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
    pub(crate) fn symbols_ready(&self) -> bool {
        self.syms.get().is_some()
    }

    /// The symbol table, read now if nobody has (a caller racing the loader waits for it).
    pub(crate) fn load_symbols(&self) -> &ModuleSymbols {
        self.syms.get_or_init(|| self.read_symbol_table())
    }

    fn read_symbol_table(&self) -> ModuleSymbols {
        let Ok(obj) = object::File::parse(&self.map[..]) else {
            return ModuleSymbols {
                symbols: Vec::new(),
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
    pub(super) fn bias(&self, map_start: u64, offset: u64) -> u64 {
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

    pub(super) fn unwind_info(&self) -> ExplicitModuleSectionInfo<Section> {
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
}

/// The largest function (address range, svma) listed in an `.eh_frame_hdr` search table,
/// measured as the distance to the next entry. Only the encodings every x86-64 toolchain
/// writes are read (pcrel sdata4 pointer, udata4 count, datarel sdata4 table); else `None`.
pub(crate) fn largest_fde(hdr: &[u8], hdr_svma: u64) -> Option<Range<u64>> {
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
