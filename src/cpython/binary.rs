//! Finding the interpreter inside a process: which mapped ELF holds `_PyRuntime`, its load
//! bias, its symbols. Works for libpython shared or static, stripped or not, PIE or not, on the
//! host or in a container (files opened through `/proc/PID/map_files` or `/proc/PID/root`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSegment};

/// One mapping from `/proc/PID/maps`.
#[derive(Debug, Clone)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    pub perms: String,
    pub path: String,
}

/// Parse `/proc/PID/maps` text.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut it = line.split_whitespace();
            let range = it.next()?;
            let perms = it.next()?.to_string();
            let offset = u64::from_str_radix(it.next()?, 16).ok()?;
            let _dev = it.next()?;
            let _inode = it.next()?;
            let path = it.collect::<Vec<_>>().join(" ");
            let (s, e) = range.split_once('-')?;
            Some(Mapping {
                start: u64::from_str_radix(s, 16).ok()?,
                end: u64::from_str_radix(e, 16).ok()?,
                offset,
                perms,
                path,
            })
        })
        .collect()
}

/// The interpreter core of a process: the ELF file holding `_PyRuntime`, as loaded.
#[derive(Debug, Clone, serde::Serialize)]
pub struct InterpreterBinary {
    /// The path as the target sees it (inside its mount namespace).
    pub path: String,
    /// Where we opened it from.
    pub opened_from: PathBuf,
    pub is_shared_lib: bool,
    pub pie: bool,
    pub stripped: bool,
    pub build_id: Option<String>,
    /// Load bias: runtime address = file virtual address + bias.
    pub bias: u64,
    /// Runtime address of `_PyRuntime`.
    pub runtime_addr: u64,
    /// How `_PyRuntime` was found: "dynsym", "symtab" or ".PyRuntime section".
    pub runtime_found_by: String,
    /// Runtime addresses of other symbols we use, where present.
    pub symbols: HashMap<String, u64>,
    /// Runtime address range of `.bss` (for the 3.10 version-string scan).
    pub bss: Option<(u64, u64)>,
}

/// Symbols worth resolving. Debian builds carry LTO suffixes (`take_gil.lto_priv.0`); names are
/// matched up to the first `.`.
const WANTED: &[&str] = &[
    "_PyRuntime",
    "Py_Version",
    "PyCode_Type",
    "_Py_NoneStruct",
    "take_gil",
    "drop_gil",
    "gc_collect_main",
    "_PyGC_Collect",
    "_Py_RunGC",
    "gc_collect",
    "PyGC_Collect",
    "_PyGC_CollectNoFail",
];

/// A place whose execution begins or ends one GC pause, for the uprobe method.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collector {
    /// The function (or the function the instruction is in).
    pub name: &'static str,
    /// File to attach to (opened through the target's mapping) and the offset in it (for a
    /// [`CollectorSite::Call`], the function's entry: where its uretprobe goes).
    pub path: PathBuf,
    pub file_offset: u64,
    /// Where the pause's start is probed: `file_offset`, except for a call whose first
    /// instruction the kernel would single-step out of line (`endbr64`, `sub rsp`): a second
    /// trap, ~30 us here, inside the pause. Such a start is probed at the first instruction
    /// that the kernel emulates on the straight-line path from the entry ([`call_start`]).
    pub enter_file_offset: u64,
    pub site: CollectorSite,
}

/// How a [`Collector`] marks a pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectorSite {
    /// A function whose call spans the pause (uprobe at its entry, uretprobe at its return).
    /// With `generation_arg`, its second argument is the generation (`gc_collect_main`,
    /// `_PyGC_Collect`).
    Call { generation_arg: bool },
    /// The instruction that sets `gcstate->collecting` (a uprobe fires before it runs).
    FlagSet,
    /// The instruction that clears it.
    FlagClear,
}

/// The functions whose calls span the GC pauses of an interpreter of version 3.`minor`, from
/// its symbol table, chosen so that each call spans what the `collecting` watchpoint spans
/// (the flag set, the gc.callbacks, the collection, the flag cleared) where a function does:
///
/// * 3.12: the flag is set by the collector's callers: `_Py_RunGC` (automatic collections),
///   `gc_collect` (`gc.collect()`), `PyGC_Collect` and `_PyGC_CollectNoFail`;
/// * 3.13: `gc_collect_main` sets and clears it itself;
/// * 3.14+: `_PyGC_Collect` does (`gc_collect_main` is gone);
/// * 3.10/3.11: no function spans the flag (it is set inline in the allocator, at every GC
///   allocation; `gc_collect_main`, inside the gc.callbacks, read the longest pauses 10-16%
///   short), so the instructions that set and clear it are probed instead
///   ([`find_flag_stores`]); `collecting_disp` is the flag's offset in the interpreter state.
///
/// On a stripped 3.13+ (Debian's static builds) the collector is found without `.symtab`
/// ([`collector_from_api`]): it is what the exported `PyGC_Collect` calls.
///
/// Err says why not (a stripped interpreter, a symbol missing).
pub fn find_collectors(
    bin: &InterpreterBinary,
    minor: u8,
    collecting_disp: u64,
) -> Result<Vec<Collector>, String> {
    if minor <= 11 {
        return find_flag_stores(bin, minor, collecting_disp);
    }
    let names: &[(&'static str, bool)] = match minor {
        12 => &[
            ("_Py_RunGC", false),
            ("gc_collect", false),
            ("PyGC_Collect", false),
            ("_PyGC_CollectNoFail", false),
        ],
        m if m >= 14 => &[("_PyGC_Collect", true)],
        _ => &[("gc_collect_main", true)],
    };
    let first = names[0].0;
    if !bin.symbols.contains_key(first) {
        if minor >= 13 {
            let found = collector_from_api(bin, names[0].0, collecting_disp);
            if bin.stripped || found.is_ok() {
                return found.map(|c| vec![c]);
            }
        }
        return Err(if bin.stripped {
            format!(
                "{} is stripped (no .symtab, so no {first} to put a uprobe on)",
                bin.path
            )
        } else {
            format!("no {first} symbol in {}", bin.path)
        });
    }
    let file = std::fs::File::open(&bin.opened_from)
        .map_err(|e| format!("opening {}: {e}", bin.opened_from.display()))?;
    let data = object::ReadCache::new(file);
    let mut out = Vec::new();
    for &(name, generation_arg) in names {
        let Some(&addr) = bin.symbols.get(name) else {
            continue;
        };
        let vaddr = addr.wrapping_sub(bin.bias);
        out.push(collector_at(
            &data,
            bin,
            name,
            vaddr,
            CollectorSite::Call { generation_arg },
        )?);
    }
    Ok(out)
}

/// How far the decoders below read from a function's start (bytes).
const API_WINDOW: usize = 1024;

/// 3.13+ without `.symtab`: the collector (`gc_collect_main` on 3.13, `_PyGC_Collect` on 3.14+,
/// `name`) is the first direct call of `PyGC_Collect`, which stripped builds still export in
/// `.dynsym` (`PyGC_Collect` is public API: `gc_collect_main(tstate, 2, MANUAL)` /
/// `_PyGC_Collect(tstate, 2, MANUAL)`). The callee is accepted only if it sets the collecting
/// flag itself ([`sets_collecting`]): the `lock cmpxchg` of `_Py_atomic_compare_exchange_int(
/// &gcstate->collecting, &expected, 1)` at `[interp + collecting_disp]`. Measured on sid
/// 3.13.18, 3.14.10, 3.15.2: that callee is the only code that sets it, and a uprobe +
/// uretprobe there spans what the symbol path's does.
pub(crate) fn collector_from_api(
    bin: &InterpreterBinary,
    name: &'static str,
    collecting_disp: u64,
) -> Result<Collector, String> {
    use object::{Object as _, ObjectSection as _};
    let api = bin
        .symbols
        .get("PyGC_Collect")
        .ok_or_else(|| format!("no {name} nor PyGC_Collect symbol in {}", bin.path))?
        .wrapping_sub(bin.bias);
    let data = std::fs::read(&bin.opened_from)
        .map_err(|e| format!("reading {}: {e}", bin.opened_from.display()))?;
    let file = object::File::parse(&*data)
        .map_err(|e| format!("parsing {}: {e}", bin.opened_from.display()))?;
    let code_at = |vaddr: u64| -> Option<&[u8]> {
        let sec = file
            .sections()
            .find(|s| s.address() <= vaddr && vaddr < s.address().saturating_add(s.size()))?;
        let avail = sec.address().saturating_add(sec.size()) - vaddr;
        sec.data_range(vaddr, avail.min(API_WINDOW as u64)).ok()?
    };
    let callee = code_at(api)
        .and_then(|b| first_direct_call(b, api))
        .ok_or_else(|| format!("no direct call in PyGC_Collect ({api:#x}) of {}", bin.path))?;
    if !code_at(callee).is_some_and(|b| sets_collecting(b, callee, collecting_disp)) {
        return Err(format!(
            "PyGC_Collect's callee at {callee:#x} in {} does not set the collecting flag (+{collecting_disp:#x}): not the collector",
            bin.path
        ));
    }
    collector_at(
        &*data,
        bin,
        name,
        callee,
        CollectorSite::Call {
            generation_arg: true,
        },
    )
}

/// The instructions of `bytes` at `addr`, up to the first that does not decode: past it, the
/// decoder's idea of where instructions begin is a guess, and a uprobe placed on a guess
/// inside an instruction would corrupt the target's code.
fn decode_all(bytes: &[u8], addr: u64) -> Vec<iced_x86::Instruction> {
    let mut d = iced_x86::Decoder::with_ip(64, bytes, addr, iced_x86::DecoderOptions::NONE);
    // Bounded by the bytes: each instruction consumes at least one.
    std::iter::from_fn(|| d.can_decode().then(|| d.decode()))
        .take_while(|i| !i.is_invalid())
        .collect()
}

/// The target of the first direct call in the code `bytes` at `addr`, before any return.
pub fn first_direct_call(bytes: &[u8], addr: u64) -> Option<u64> {
    use iced_x86::{FlowControl, OpKind};
    for i in decode_all(bytes, addr) {
        match i.flow_control() {
            FlowControl::Call if i.op0_kind() == OpKind::NearBranch64 => {
                return Some(i.near_branch_target())
            }
            FlowControl::Return => return None,
            _ => {}
        }
    }
    None
}

/// Whether the code `bytes` at `addr` does a 32-bit `lock cmpxchg` on `[base + disp]`,
/// directly or through a register loaded by `lea reg, [base + disp]` (and not written again
/// before the exchange).
pub fn sets_collecting(bytes: &[u8], addr: u64, disp: u64) -> bool {
    use iced_x86::{Mnemonic, OpKind, Register};
    let code = decode_all(bytes, addr);
    let mut info = iced_x86::InstructionInfoFactory::new();
    let mut via: Vec<Register> = Vec::new();
    for i in &code {
        let mem32 = i.op0_kind() == OpKind::Memory
            && i.memory_size() == iced_x86::MemorySize::UInt32
            && i.memory_index() == Register::None;
        if i.mnemonic() == Mnemonic::Cmpxchg && i.has_lock_prefix() && mem32 {
            let d = i.memory_displacement64();
            if d == disp || d == 0 && via.contains(&i.memory_base()) {
                return true;
            }
        }
        if i.mnemonic() == Mnemonic::Lea
            && i.op0_kind() == OpKind::Register
            && i.memory_index() == Register::None
            && i.memory_displacement64() == disp
            && i.memory_base() != Register::RIP
        {
            via.push(i.op0_register().full_register());
            continue;
        }
        // Any other write to a tracked register ends what it held.
        if !via.is_empty() {
            let info = info.info(i);
            for u in info.used_registers() {
                if !matches!(
                    u.access(),
                    iced_x86::OpAccess::Read | iced_x86::OpAccess::CondRead
                ) {
                    let r = u.register().full_register();
                    via.retain(|&v| v != r);
                }
            }
        }
    }
    false
}

/// A [`Collector`] at virtual address `vaddr` (in `name`) of the ELF image `data` of `bin`.
fn collector_at<'data, R: object::ReadRef<'data>>(
    data: R,
    bin: &InterpreterBinary,
    name: &'static str,
    vaddr: u64,
    site: CollectorSite,
) -> Result<Collector, String> {
    let file_offset = file_offset_of(data, vaddr).ok_or_else(|| {
        format!(
            "{name} at {vaddr:#x} is in no loadable segment of {}",
            bin.path
        )
    })?;
    let (mut enter_file_offset, mut site) = (file_offset, site);
    if let CollectorSite::Call { generation_arg } = site {
        if let Ok(code) = data.read_bytes_at(file_offset, 128) {
            let (start, rsi_kept) = call_start(code, vaddr);
            enter_file_offset = file_offset + (start - vaddr);
            site = CollectorSite::Call {
                generation_arg: generation_arg && rsi_kept,
            };
        }
    }
    Ok(Collector {
        name,
        path: bin.opened_from.clone(),
        file_offset,
        enter_file_offset,
        site,
    })
}

/// Whether the kernel runs instruction `i` without single-stepping it out of line at a uprobe
/// (it emulates direct calls and jumps, conditional jumps, `push reg` and a one-byte `nop`).
fn kernel_emulates(i: &iced_x86::Instruction) -> bool {
    use iced_x86::{FlowControl, Mnemonic, OpKind};
    match i.flow_control() {
        FlowControl::Call | FlowControl::UnconditionalBranch => {
            matches!(i.op0_kind(), OpKind::NearBranch64)
        }
        FlowControl::ConditionalBranch => i.is_jcc_short_or_near(),
        FlowControl::Next => {
            i.mnemonic() == Mnemonic::Nop && i.len() == 1
                || i.mnemonic() == Mnemonic::Push && i.op0_kind() == OpKind::Register
        }
        _ => false,
    }
}

/// Where to probe the start of a call of the function whose code at `addr` is `code`: its
/// entry if the kernel emulates the first instruction, else the first one it emulates among
/// the next 16 when only straight-line code lies between (every call runs it, right after
/// the entry), else the entry. Also whether `rsi` (the second argument) still holds what it
/// held at the entry there.
pub fn call_start(code: &[u8], addr: u64) -> (u64, bool) {
    let code = decode_all(code, addr);
    let Some(j) = next_emulated(&code, 0) else {
        return (addr, true);
    };
    let mut info = iced_x86::InstructionInfoFactory::new();
    let rsi_kept = !code[..j].iter().any(|i| {
        info.info(i).used_registers().iter().any(|u| {
            u.register().full_register() == iced_x86::Register::RSI
                && !matches!(
                    u.access(),
                    iced_x86::OpAccess::Read | iced_x86::OpAccess::CondRead
                )
        })
    });
    (code[j].ip(), rsi_kept)
}

/// The index of the first instruction that the kernel emulates among `code[k]` and the 16
/// after it, when only straight-line code lies before it (so that whatever runs `code[k]` runs
/// it right after): where a uprobe costs no single-step.
fn next_emulated(code: &[iced_x86::Instruction], k: usize) -> Option<usize> {
    for (j, i) in code.iter().enumerate().skip(k).take(17) {
        if kernel_emulates(i) {
            return Some(j);
        }
        if i.flow_control() != iced_x86::FlowControl::Next {
            break;
        }
    }
    None
}

/// The functions of 3.10/3.11 that set and clear `gcstate->collecting` around a collection:
/// automatic collections inside the GC allocator (3.11 `_PyObject_GC_Link`; 3.10
/// `_PyObject_GC_Malloc`/`_Calloc`, or `_PyObject_GC_Alloc` where it is not inlined), then
/// `gc.collect()`, `PyGC_Collect` and `_PyGC_CollectNoFail`. The allocator's are required.
const FLAG_FUNCTIONS_311: &[(&str, bool)] = &[
    ("_PyObject_GC_Link", true),
    ("gc_collect", false),
    ("PyGC_Collect", false),
    ("_PyGC_CollectNoFail", false),
];
const FLAG_FUNCTIONS_310: &[(&str, bool)] = &[
    ("_PyObject_GC_Malloc", true),
    ("_PyObject_GC_Calloc", false),
    ("_PyObject_GC_Alloc", false),
    ("gc_collect", false),
    ("PyGC_Collect", false),
    ("_PyGC_CollectNoFail", false),
];

/// The longest function decoded (bytes): these are a few hundred.
const MAX_FLAG_FUNCTION: u64 = 16 << 10;

/// 3.10/3.11: the instructions that store 1 and 0 into `gcstate->collecting` in the functions
/// that run collections ([`FLAG_FUNCTIONS_311`]), found by decoding each function from its
/// symbol (so every offset is an instruction boundary, which a uprobe must be) and keeping the
/// 32-bit stores of an immediate 1 or 0 to `[reg + collecting_disp]` (the flag's offset in the
/// interpreter state: the code reaches it from `tstate->interp`). Each function must show at
/// least one set and one clear through the same base register, else it is left out; a
/// required one left out means no uprobes at all (the watchpoint instead).
pub(crate) fn find_flag_stores(
    bin: &InterpreterBinary,
    minor: u8,
    collecting_disp: u64,
) -> Result<Vec<Collector>, String> {
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
    if bin.stripped {
        return Err(format!(
            "{} is stripped (no .symtab, so no collector function to find the collecting flag's stores in)",
            bin.path
        ));
    }
    let wanted = if minor <= 10 {
        FLAG_FUNCTIONS_310
    } else {
        FLAG_FUNCTIONS_311
    };
    let data = std::fs::read(&bin.opened_from)
        .map_err(|e| format!("reading {}: {e}", bin.opened_from.display()))?;
    let file = object::File::parse(&*data)
        .map_err(|e| format!("parsing {}: {e}", bin.opened_from.display()))?;
    // One pass over the symbol table: the first text symbol of each wanted name (LTO
    // suffixes allowed, `.cold` parts not).
    let mut syms: HashMap<&str, object::Symbol<'_, '_>> = HashMap::new();
    for sym in file.symbols() {
        if sym.kind() != object::SymbolKind::Text {
            continue;
        }
        let Ok(n) = sym.name() else { continue };
        let base = n.split('.').next().unwrap_or(n);
        if !n.ends_with(".cold") && wanted.iter().any(|&(w, _)| w == base) {
            syms.entry(base).or_insert(sym);
        }
    }
    let mut out = Vec::new();
    let mut missing = Vec::new();
    for &(name, required) in wanted {
        let found = syms.get(name).and_then(|sym| {
            let (addr, size) = (sym.address(), sym.size().min(MAX_FLAG_FUNCTION));
            let sec = file.section_by_index(sym.section_index()?).ok()?;
            let bytes = sec.data_range(addr, size).ok()??;
            flag_stores(bytes, addr, collecting_disp)
        });
        match found {
            Some((set, clear)) => {
                for (vaddr, site) in set
                    .into_iter()
                    .map(|a| (a, CollectorSite::FlagSet))
                    .chain(clear.into_iter().map(|a| (a, CollectorSite::FlagClear)))
                {
                    out.push(collector_at(&*data, bin, name, vaddr, site)?);
                }
            }
            None if required => missing.push(name),
            None => {}
        }
    }
    if !missing.is_empty() {
        return Err(format!(
            "no store to the collecting flag (+{collecting_disp:#x}) found in {} of {}",
            missing.join(", "),
            bin.path
        ));
    }
    Ok(out)
}

/// In the code `bytes` of a function at virtual address `addr`: where to probe the 32-bit
/// stores of 1 and of 0 to `[reg + disp]`, for the one base register that has both (the first
/// such in register order); `None` if none has both.
///
/// A uprobe fires before its instruction runs: at a clear, the trap's entry falls inside the
/// pause and the rest after it, so clears are probed at the store. At a set, what follows the
/// handler falls inside: where the kernel single-steps the instruction out of line (a store),
/// that is a second trap (~10 us here: +8% on 3.11's ~0.2 ms young collections). So a set is
/// probed at the first instruction after the store that the kernel emulates instead (a direct
/// call, jump or conditional jump, a push or a nop) when only straight-line code lies between,
/// which runs right after the store, a few loads and compares later; else at the store.
pub fn flag_stores(bytes: &[u8], addr: u64, disp: u64) -> Option<(Vec<u64>, Vec<u64>)> {
    use iced_x86::{Mnemonic, OpKind, Register};
    let code = decode_all(bytes, addr);
    // The store itself (a `mov`) is not emulated: the first emulated instruction after it.
    let set_point = |k: usize| next_emulated(&code, k).map_or(code[k].ip(), |j| code[j].ip());
    let mut by_reg: std::collections::BTreeMap<Register, (Vec<u64>, Vec<u64>)> = Default::default();
    for (k, ins) in code.iter().enumerate() {
        if ins.mnemonic() != Mnemonic::Mov
            || ins.op_count() != 2
            || ins.op0_kind() != OpKind::Memory
            || ins.op1_kind() != OpKind::Immediate32
            || ins.memory_size() != iced_x86::MemorySize::UInt32
            || ins.memory_index() != Register::None
            || ins.memory_displacement64() != disp
        {
            continue;
        }
        let e = by_reg.entry(ins.memory_base()).or_default();
        match ins.immediate32() {
            1 => e.0.push(set_point(k)),
            0 => e.1.push(ins.ip()),
            _ => {}
        }
    }
    by_reg
        .into_values()
        .find(|(set, clear)| !set.is_empty() && !clear.is_empty())
}

/// File offset of virtual address `vaddr` in an ELF image: inside the executable PT_LOAD
/// segment that maps it.
pub(crate) fn file_offset_of<'data, R: object::ReadRef<'data>>(data: R, vaddr: u64) -> Option<u64> {
    let file = object::File::parse(data).ok()?;
    file.segments().find_map(|seg| {
        let (off, size) = seg.file_range();
        let start = seg.address();
        (vaddr >= start && vaddr - start < size).then(|| off + (vaddr - start))
    })
}

/// Open a mapped file the way that works from the host whatever the target's mount namespace:
/// `/proc/PID/map_files/START-END`, then `/proc/PID/root/PATH`, then `PATH`.
pub(crate) fn open_mapped_file(
    pid: i32,
    m: &Mapping,
) -> Option<(PathBuf, object::ReadCache<std::fs::File>)> {
    let candidates = [
        PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end)),
        Path::new(&format!("/proc/{pid}/root")).join(m.path.trim_start_matches('/')),
        PathBuf::from(&m.path),
    ];
    for c in candidates {
        // Read on demand (headers, symbol tables): binaries with debug info are tens of MB, and
        // a file the target owns must not be able to crash us the way a truncated mmap would.
        if let Ok(file) = std::fs::File::open(&c) {
            return Some((c, object::ReadCache::new(file)));
        }
    }
    None
}

/// Inspect one ELF image; `None` if it does not hold `_PyRuntime`.
pub fn inspect_elf<'data, R: object::ReadRef<'data>>(data: R) -> Option<ElfFacts> {
    use object::read::elf::{SectionHeader as _, Sym as _};
    let elf = object::read::elf::ElfFile64::<object::Endianness, R>::parse(data).ok()?;
    let file = object::File::parse(data).ok()?;
    let endian = elf.endian();
    let sections = elf.elf_section_table();
    let mut symbols: HashMap<String, u64> = HashMap::new();
    let mut runtime_found_by = None;
    let mut has_symtab = false;
    // Walk .dynsym then .symtab with each table and its string table read in one piece: the
    // generic symbol iterator reads names piecemeal, which is slow through a read cache.
    for (kind, label) in [
        (object::elf::SHT_DYNSYM, "dynsym"),
        (object::elf::SHT_SYMTAB, "symtab"),
    ] {
        for sec in sections.iter().filter(|s| s.sh_type(endian) == kind) {
            has_symtab |= kind == object::elf::SHT_SYMTAB;
            let Ok(raw) = sec.data(endian, data) else {
                continue;
            };
            let Ok(strsec) = sections.section(object::SectionIndex(sec.sh_link(endian) as usize))
            else {
                continue;
            };
            let Ok(strings) = strsec.data(endian, data) else {
                continue;
            };
            let Ok((syms, _)) =
                object::pod::slice_from_bytes::<object::elf::Sym64<object::Endianness>>(
                    raw,
                    raw.len() / std::mem::size_of::<object::elf::Sym64<object::Endianness>>(),
                )
            else {
                continue;
            };
            for sym in syms {
                let start = sym.st_name(endian) as usize;
                let Some(tail) = strings.get(start..) else {
                    continue;
                };
                let end = tail.iter().position(|&b| b == 0).unwrap_or(tail.len());
                let Ok(name) = std::str::from_utf8(&tail[..end]) else {
                    continue;
                };
                let base = name.split('.').next().unwrap_or(name);
                let addr = sym.st_value(endian);
                if WANTED.contains(&base) && addr != 0 && !name.ends_with(".cold") {
                    if base == "_PyRuntime" && runtime_found_by.is_none() {
                        runtime_found_by = Some(label.to_string());
                    }
                    symbols.entry(base.to_string()).or_insert(addr);
                }
            }
        }
    }
    if !symbols.contains_key("_PyRuntime") {
        // 3.13+ keep `_PyRuntime` in its own section so tools can find it without symbols.
        if let Some(sec) = file.section_by_name(".PyRuntime") {
            symbols.insert("_PyRuntime".into(), sec.address());
            runtime_found_by = Some(".PyRuntime section".into());
        }
    }
    let runtime_found_by = runtime_found_by?;
    let is_dyn = matches!(file.kind(), object::ObjectKind::Dynamic);
    let first_load = file.segments().map(|s| s.address()).min().unwrap_or(0);
    let bss = file
        .section_by_name(".bss")
        .map(|s| (s.address(), s.address().saturating_add(s.size())));
    let build_id = file
        .build_id()
        .ok()
        .flatten()
        .map(|b| b.iter().map(|x| format!("{x:02x}")).collect());
    Some(ElfFacts {
        symbols,
        runtime_found_by,
        is_dyn,
        first_load_vaddr: first_load,
        stripped: !has_symtab,
        build_id,
        bss,
    })
}

/// What [`inspect_elf`] learned from a file, before relocation.
#[derive(Debug, Clone)]
pub struct ElfFacts {
    pub symbols: HashMap<String, u64>,
    pub runtime_found_by: String,
    pub is_dyn: bool,
    pub first_load_vaddr: u64,
    pub stripped: bool,
    pub build_id: Option<String>,
    pub bss: Option<(u64, u64)>,
}

/// [`inspect_elf`] of a mapped file, read once per file: engines run several processes of
/// one interpreter, and each reader of a target (the recorder, its task readers, `top`'s
/// replay) attaches on its own; a shared libpython's symbol tables took hundreds of ms per
/// read on a loaded machine. Keyed by the file's device, inode, size and modification time,
/// so a file replaced in place is read again.
fn inspect_mapped(pid: i32, m: &Mapping) -> Option<(PathBuf, std::sync::Arc<ElfFacts>)> {
    use std::os::unix::fs::MetadataExt;
    use std::sync::{Arc, Mutex};
    type Key = (u64, u64, u64, i64, i64);
    static CACHE: Mutex<Option<HashMap<Key, Option<Arc<ElfFacts>>>>> = Mutex::new(None);
    let (opened_from, data) = open_mapped_file(pid, m)?;
    let key = std::fs::metadata(&opened_from)
        .ok()
        .map(|md| (md.dev(), md.ino(), md.size(), md.mtime(), md.mtime_nsec()));
    if let Some(k) = key {
        if let Ok(c) = CACHE.lock() {
            if let Some(hit) = c.as_ref().and_then(|c| c.get(&k)) {
                return hit.clone().map(|f| (opened_from, f));
            }
        }
    }
    let facts = inspect_elf(&data).map(Arc::new);
    if let (Some(k), Ok(mut c)) = (key, CACHE.lock()) {
        let c = c.get_or_insert_with(HashMap::new);
        // Bounded: a host with many interpreters starts over rather than grow.
        if c.len() >= 64 {
            c.clear();
        }
        c.insert(k, facts.clone());
    }
    facts.map(|f| (opened_from, f))
}

/// Find the interpreter core among a process's mappings.
pub fn find_interpreter(pid: i32, maps: &[Mapping]) -> Option<InterpreterBinary> {
    // Candidate files in map order (the executable comes first), each once.
    let mut seen = std::collections::HashSet::new();
    for m in maps {
        if m.offset != 0
            || m.path.is_empty()
            || m.path.starts_with('[')
            || !seen.insert(m.path.clone())
        {
            continue;
        }
        let base_name = m.path.rsplit('/').next().unwrap_or("");
        // Cheap filter: only files that can be an interpreter core. Names are a hint for which
        // file to open, never for the version.
        let plausible = base_name.contains("python") || m.path == exe_path(pid).unwrap_or_default();
        if !plausible {
            continue;
        }
        let Some((opened_from, facts)) = inspect_mapped(pid, m) else {
            continue;
        };
        // The mapping with file offset 0 is the start of the first PT_LOAD segment.
        let bias = if facts.is_dyn {
            m.start.wrapping_sub(facts.first_load_vaddr & !0xfff)
        } else {
            0
        };
        let symbols: HashMap<String, u64> = facts
            .symbols
            .iter()
            .map(|(k, v)| (k.clone(), v.wrapping_add(bias)))
            .collect();
        return Some(InterpreterBinary {
            path: m.path.clone(),
            opened_from,
            is_shared_lib: base_name.contains(".so"),
            pie: facts.is_dyn,
            stripped: facts.stripped,
            build_id: facts.build_id.clone(),
            bias,
            runtime_addr: symbols["_PyRuntime"],
            runtime_found_by: facts.runtime_found_by.clone(),
            symbols,
            bss: facts
                .bss
                .map(|(s, e)| (s.wrapping_add(bias), e.wrapping_add(bias))),
        });
    }
    None
}

fn exe_path(pid: i32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `elf` fuzz target (issue 15): a `.bss` section whose address plus size
    /// passes 2^64 overflowed computing its end. The input is the fuzzer's, kept as it was.
    #[test]
    fn bss_at_the_top_of_the_address_space() {
        // Aligned as a mapped or heap-read file is: the symbol table is read in place, and
        // `include_bytes!` alone gives whatever alignment the linker picked (the test passed
        // or failed with unrelated changes to the test binary).
        #[repr(C, align(16))]
        struct Aligned<T: ?Sized>(T);
        static DATA: &Aligned<[u8]> = &Aligned(*include_bytes!("testdata/fuzz-elf-bss-overflow"));
        let facts = inspect_elf(&DATA.0[..]).expect("still holds _PyRuntime");
        let (start, end) = facts.bss.expect(".bss");
        assert!(end >= start);
    }

    #[test]
    fn maps_parse() {
        let m = parse_maps(
            "00400000-00422000 r--p 00000000 fe:01 123 /usr/bin/python3.14\n\
             7f00-7f10 rw-p 00000000 00:00 0 \n\
             7f10-7f20 r-xp 00001000 fe:01 9 /opt/my dir/libpython3.12.so.1.0\n\
             garbage\n",
        );
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].start, 0x400000);
        assert_eq!(m[1].path, "");
        assert_eq!(m[2].path, "/opt/my dir/libpython3.12.so.1.0");
        assert_eq!(m[2].offset, 0x1000);
    }

    #[test]
    fn not_an_elf() {
        assert!(inspect_elf(&b"not an elf at all"[..]).is_none());
        assert!(inspect_elf(&[][..]).is_none());
    }

    /// The code of 3.11.7's `_PyObject_GC_Link` around the flag (objdump of pyenv's
    /// libpython), with decoys: a store of 2, a set through another base register that has
    /// no clear, and the bytes of a set inside a `movabs` immediate.
    #[test]
    fn flag_stores_are_found_on_instruction_boundaries() {
        let code: &[u8] = &[
            0x48, 0xb8, 0xc7, 0x83, 0x50, 0x03, 0x00, 0x00, 0x01, 0x00, // movabs (decoy) +0
            0xc7, 0x83, 0x50, 0x03, 0x00, 0x00, 0x01, 0x00, 0x00,
            0x00, // movl $1,0x350(%rbx) +10
            0x8b, 0x83, 0xe0, 0x02, 0x00, 0x00, // mov 0x2e0(%rbx),%eax +20
            0xc7, 0x83, 0x50, 0x03, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, // movl $2 +26
            0x41, 0xc7, 0x84, 0x24, 0x50, 0x03, 0x00, 0x00, 0x01, 0x00, 0x00,
            0x00, // movl $1,0x350(%r12) +36
            0xe8, 0x01, 0xe1, 0xff, 0xff, // call +48
            0xc7, 0x83, 0x50, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, // movl $0,0x350(%rbx) +53
            0xc3, // ret +63
        ];
        let base = 0x2bcb80;
        let (set, clear) = flag_stores(code, base, 0x350).unwrap();
        // The set is probed at the call after it (emulated: only straight-line code between),
        // the clear at the store.
        assert_eq!(set, vec![base + 48]);
        assert_eq!(clear, vec![base + 53]);
        // With a return between, the set is probed at the store itself.
        let mut with_ret = code.to_vec();
        with_ret[20] = 0xc3;
        with_ret[21..26].copy_from_slice(&[0x90; 5]);
        let (set, _) = flag_stores(&with_ret, base, 0x350).unwrap();
        assert_eq!(set, vec![base + 10]);
        // Another offset: nothing.
        assert!(flag_stores(code, base, 0x354).is_none());
        // Truncated code and garbage never panic.
        for n in 0..code.len() {
            let _ = flag_stores(&code[..n], base, 0x350);
        }
        let mut x = 0x9e3779b97f4a7c15u64;
        let garbage: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let _ = flag_stores(&garbage, 0, 0x350);
    }

    /// sid 3.14.10 (stripped, static): the start of `PyGC_Collect` (exported) up to its call of
    /// `_PyGC_Collect`, and the start of `_PyGC_Collect` up to the flag's `lock cmpxchg`
    /// through `lea rbx, [rax + 0x1db0]` (objdump of /usr/bin/python3.14).
    const PYGC_COLLECT_314: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x83, 0xec, 0x18, 0x48, 0x89, 0x1c, 0x24, 0x48, 0x89, 0x6c,
        0x24, 0x08, 0x64, 0x48, 0x8b, 0x1c, 0x25, 0xe8, 0xff, 0xff, 0xff, 0x48, 0x8b, 0x43, 0x10,
        0x83, 0xb8, 0xfc, 0x1c, 0x00, 0x00, 0x00, 0x0f, 0x84, 0xf7, 0xee, 0xd3, 0xff, 0x31, 0xc0,
        0x4c, 0x89, 0x64, 0x24, 0x10, 0x4c, 0x8b, 0x63, 0x70, 0xba, 0x02, 0x00, 0x00, 0x00, 0x48,
        0x89, 0x43, 0x70, 0xbe, 0x02, 0x00, 0x00, 0x00, 0x48, 0x89, 0xdf, 0xe8, 0xb4, 0x8f, 0xe4,
        0xff,
    ];
    const PYGC_COLLECT_CALLEE_314: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x45, 0x31, 0xdb, 0x48, 0x89, 0xe5, 0x48, 0x81, 0xec, 0x20,
        0x01, 0x00, 0x00, 0x48, 0x8b, 0x47, 0x10, 0x48, 0x89, 0x5d, 0xd8, 0x89, 0xb5, 0x1c, 0xff,
        0xff, 0xff, 0x48, 0x8d, 0x98, 0xb0, 0x1d, 0x00, 0x00, 0x89, 0xd6, 0xba, 0x01, 0x00, 0x00,
        0x00, 0x48, 0x89, 0x85, 0x28, 0xff, 0xff, 0xff, 0x31, 0xc0, 0x4c, 0x89, 0x6d, 0xe8, 0x4c,
        0x89, 0x9d, 0x30, 0xff, 0xff, 0xff, 0x48, 0x89, 0x9d, 0xe0, 0xfe, 0xff, 0xff, 0xf0, 0x0f,
        0xb1, 0x13, 0x0f, 0x85, 0x72, 0x17, 0x00, 0x00,
    ];

    #[test]
    fn the_collector_of_a_stripped_build_is_pygc_collects_callee() {
        assert_eq!(
            first_direct_call(PYGC_COLLECT_314, 0x750660),
            Some(0x599660)
        );
        assert!(sets_collecting(PYGC_COLLECT_CALLEE_314, 0x599660, 0x1db0));
        // Another flag's offset, or the register overwritten between the lea and the
        // exchange (`mov rbx, rax` spliced in before the `lock cmpxchg`), is not the collector.
        assert!(!sets_collecting(PYGC_COLLECT_CALLEE_314, 0x599660, 0x1db4));
        let n = PYGC_COLLECT_CALLEE_314.len() - 10;
        let mut spliced = PYGC_COLLECT_CALLEE_314[..n].to_vec();
        spliced.extend_from_slice(&[0x48, 0x89, 0xc3]);
        spliced.extend_from_slice(&PYGC_COLLECT_CALLEE_314[n..]);
        assert!(sets_collecting(PYGC_COLLECT_CALLEE_314, 0, 0x1db0));
        assert!(!sets_collecting(&spliced, 0, 0x1db0));
        // PyGC_Collect itself sets no flag; a return before any call means no callee.
        assert!(!sets_collecting(PYGC_COLLECT_314, 0x750660, 0x1db0));
        assert_eq!(first_direct_call(&[0xc3, 0xe8, 0, 0, 0, 0], 0), None);
        // Where the pause's start is probed: past `endbr64` (single-stepped) at the `push rbp`;
        // in PyGC_Collect, past `endbr64; sub rsp` and loads at the `je`; `rsi` untouched in
        // both. An emulated first instruction is the entry itself.
        assert_eq!(
            call_start(PYGC_COLLECT_CALLEE_314, 0x599660),
            (0x599664, true)
        );
        assert_eq!(call_start(PYGC_COLLECT_314, 0x750660), (0x750685, true));
        assert_eq!(
            call_start(&PYGC_COLLECT_CALLEE_314[4..], 0x599664),
            (0x599664, true)
        );
        // `mov esi, 2` (be 02 00 00 00) before the first emulated instruction: rsi not kept.
        let mut rsi = vec![0xf3, 0x0f, 0x1e, 0xfa, 0xbe, 0x02, 0x00, 0x00, 0x00, 0x55];
        assert_eq!(call_start(&rsi, 0x1000), (0x1009, false));
        // Bytes that do not decode (0x06 is invalid in 64-bit mode) end the search: the
        // `push rbp` after them might not start where the decoder thinks.
        assert_eq!(
            call_start(&[0xf3, 0x0f, 0x1e, 0xfa, 0x06, 0x55], 0x1000),
            (0x1000, true)
        );
        // No emulated instruction before a branch that is not: the entry.
        rsi.truncate(4);
        rsi.extend_from_slice(&[0xff, 0xe0, 0x55]); // jmp rax; push rbp
        assert_eq!(call_start(&rsi, 0x1000), (0x1000, true));
        // Garbage decodes to whatever it decodes to, without panicking.
        let garbage: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let _ = call_start(&garbage, 0);
        let _ = first_direct_call(&garbage, 0);
        let _ = sets_collecting(&garbage, 0, 0x1db0);
    }
}
