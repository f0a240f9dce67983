//! Python thread names, read from the interpreter: the `threading` module's registry of live
//! threads, `sys.modules["threading"]._active`, maps each thread's ident (`get_ident()`, the
//! `pthread_t` that `PyThreadState.thread_id` holds) to its `Thread` object, whose `_name` is
//! what `Thread(name=...)` or a later `thread.name = ...` set (`Thread-N (target)` by default,
//! `MainThread`, `Dummy-N` for threads `threading` did not start). Before 3.14 CPython leaves
//! the OS name (`comm`) as the parent's; from 3.14 it sets it from this name, cut to 15 bytes.
//!
//! Everything is read from outside and checked like the stack walk: dicts through bounded
//! entry tables, ints of at most three digits, strings of at most
//! [`MAX_STR_CHARS`](super::objects::MAX_STR_CHARS) characters; an
//! implausible object is an error, never a panic or an endless loop. Addresses found once
//! (the `_active` dict, the interned key strings) are kept and checked again at each read,
//! so a refresh costs a few reads per thread.

use std::collections::HashMap;

use super::memory::MemorySource;
use super::objects::{read_unicode, ObjectError};
use super::offsets::{
    DictKeysLayout, InstanceDict, Offsets, DICT_MA_KEYS, DICT_MA_VALUES, MODULE_MD_DICT,
    TPFLAGS_INLINE_VALUES, TPFLAGS_MANAGED_DICT, TYPE_BASICSIZE, TYPE_DICTOFFSET, TYPE_FLAGS,
};

/// Most entries of a dict we read (`sys.modules` of a large application has a few thousand).
pub(crate) const MAX_DICT_ENTRIES: u64 = 1 << 16;
/// Most threads whose names we read.
pub(crate) const MAX_NAMED_THREADS: usize = 4096;

/// Highest user-space address on x86-64 and aarch64 (with 5-level paging: 57 bits).
const MAX_USER_ADDR: u64 = 1 << 57;

pub(crate) fn garbage(what: &'static str, addr: u64, why: impl Into<String>) -> ObjectError {
    ObjectError::Garbage {
        what,
        addr,
        why: why.into(),
    }
}

pub(crate) fn object(what: &'static str, addr: u64) -> Result<u64, ObjectError> {
    if addr == 0 || addr >= MAX_USER_ADDR || !addr.is_multiple_of(8) {
        return Err(garbage(what, addr, "not an object address"));
    }
    Ok(addr)
}

/// The `(key, value)` pairs of a dict, in insertion order, deleted entries left out.
pub(crate) fn dict_items(
    mem: &dyn MemorySource,
    o: &Offsets,
    dict: u64,
) -> Result<Vec<(u64, u64)>, ObjectError> {
    let dict = object("dict", dict)?;
    let keys = object("dict keys", mem.read_u64(dict + DICT_MA_KEYS)?)?;
    let values = mem.read_u64(dict + DICT_MA_VALUES)?;
    let split = if values == 0 {
        None
    } else {
        Some(object("dict values", values)?)
    };
    keys_items(mem, o, keys, split)
}

/// The `(key, value)` pairs of a keys object: values from the entries (`split` None) or from
/// a split table's values array.
fn keys_items(
    mem: &dyn MemorySource,
    o: &Offsets,
    keys: u64,
    split: Option<u64>,
) -> Result<Vec<(u64, u64)>, ObjectError> {
    let (entries_at, n, entry_size, key_at, value_at, values_at) = match o.dict_keys {
        DictKeysLayout::Py310 => {
            let size = mem.read_u64(keys + 8)?;
            if !size.is_power_of_two() || size > 4 * MAX_DICT_ENTRIES {
                return Err(garbage("dict keys", keys, format!("dk_size {size}")));
            }
            let width = match size {
                0..=0xff => 1,
                0x100..=0xffff => 2,
                _ => 4,
            };
            let n = mem.read_u64(keys + 32)?;
            (keys + 40 + size * width, n, 24u64, 8u64, 16u64, 0u64)
        }
        DictKeysLayout::Py311 { values_at } => {
            let head = mem.read_vec(keys + 8, 3)?;
            let (log2_size, log2_index_bytes, kind) = (head[0], head[1], head[2]);
            if log2_size > 20 || log2_index_bytes > 23 || log2_index_bytes < log2_size || kind > 2 {
                return Err(garbage(
                    "dict keys",
                    keys,
                    format!("log2 size {log2_size}, index bytes {log2_index_bytes}, kind {kind}"),
                ));
            }
            let n = mem.read_u64(keys + 24)?;
            let size = if kind == 0 { 24 } else { 16 };
            let key_at = if kind == 0 { 8 } else { 0 };
            (
                keys + 32 + (1u64 << log2_index_bytes),
                n,
                size,
                key_at,
                key_at + 8,
                values_at,
            )
        }
    };
    if n > MAX_DICT_ENTRIES {
        return Err(garbage("dict keys", keys, format!("{n} entries")));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    let raw = mem.read_vec(entries_at, (n * entry_size) as usize)?;
    let word = |b: &[u8], at: u64| -> u64 {
        let at = at as usize;
        b.get(at..at + 8)
            .and_then(|x| x.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    let split_values = match split {
        Some(v) => Some(mem.read_vec(v + values_at, (n * 8) as usize)?),
        None => None,
    };
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let e = &raw[(i * entry_size) as usize..((i + 1) * entry_size) as usize];
        let key = word(e, key_at);
        let value = match &split_values {
            Some(v) => word(v, i * 8),
            None => word(e, value_at),
        };
        if key != 0 && value != 0 {
            out.push((key, value));
        }
    }
    Ok(out)
}

/// A non-negative int of at most 64 bits (thread idents are `pthread_t` addresses).
pub(crate) fn read_u64_int(
    mem: &dyn MemorySource,
    o: &Offsets,
    addr: u64,
) -> Result<u64, ObjectError> {
    let addr = object("int", addr)?;
    let head = mem.read_u64(addr + 16)?;
    let ndigits = if o.long_tagged {
        match head & 3 {
            0 => head >> 3,
            1 => return Ok(0),
            _ => return Err(garbage("int", addr, "negative")),
        }
    } else {
        let size = head as i64;
        if size < 0 {
            return Err(garbage("int", addr, "negative"));
        }
        size as u64
    };
    if ndigits > 3 {
        return Err(garbage("int", addr, format!("{ndigits} digits")));
    }
    let mut v: u128 = 0;
    for i in 0..ndigits {
        let d = mem.read_u32(addr + 24 + 4 * i)?;
        if d >= 1 << 30 {
            return Err(garbage("int", addr, "digit over 30 bits"));
        }
        v |= u128::from(d) << (30 * i);
    }
    u64::try_from(v).map_err(|_| garbage("int", addr, "over 64 bits"))
}

/// Reads attributes and module globals of objects in the target, keeping the addresses of the
/// interned key strings it met (keys compare by address first). Shared by the thread-name and
/// asyncio-task readers.
#[derive(Default)]
pub(crate) struct Attrs {
    /// Interned key strings met: text → address.
    interned: HashMap<&'static str, u64>,
}

/// Reads Python thread names, keeping what it found between reads.
#[derive(Default)]
pub struct ThreadNames {
    /// `threading._active`, once found (checked at each read: still a dict).
    active: Option<u64>,
    /// The type of `sys.modules` (`dict`), to check objects against.
    dict_type: u64,
    attrs: Attrs,
    /// Reads so far that found no `threading` module (not imported yet, or unreadable).
    pub misses: u64,
    /// Reads that failed (an implausible object, an unreadable address).
    pub errors: u64,
}

impl ThreadNames {
    /// Python thread names of an interpreter by thread ident (`PyThreadState.thread_id`).
    /// Empty when `threading` was never imported. `interp` is the `PyInterpreterState`.
    pub fn read(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        interp: u64,
    ) -> Result<HashMap<u64, String>, ObjectError> {
        let active = match self.active.filter(|&a| self.still_dict(mem, a)) {
            Some(a) => a,
            None => {
                self.active = None;
                match self.find_active(mem, o, interp)? {
                    Some(a) => {
                        self.active = Some(a);
                        a
                    }
                    None => {
                        self.misses += 1;
                        return Ok(HashMap::new());
                    }
                }
            }
        };
        let mut out = HashMap::new();
        for (key, thread) in dict_items(mem, o, active)? {
            if out.len() >= MAX_NAMED_THREADS {
                break;
            }
            // One unreadable entry (a thread exiting while we read) does not hide the others.
            let Ok(ident) = read_u64_int(mem, o, key) else {
                continue;
            };
            if let Ok(Some(name)) = self.attrs.attribute_str(mem, o, thread, "_name") {
                out.insert(ident, name);
            }
        }
        Ok(out)
    }

    fn still_dict(&self, mem: &dyn MemorySource, addr: u64) -> bool {
        self.dict_type != 0 && mem.read_u64(addr + 8).is_ok_and(|t| t == self.dict_type)
    }

    /// `sys.modules["threading"].__dict__["_active"]`.
    fn find_active(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        interp: u64,
    ) -> Result<Option<u64>, ObjectError> {
        let Some((dict_type, active)) =
            self.attrs
                .module_global(mem, o, interp, "threading", "_active")?
        else {
            return Ok(None);
        };
        self.dict_type = dict_type;
        if !self.still_dict(mem, active) {
            return Err(garbage("threading._active", active, "not a dict"));
        }
        Ok(Some(active))
    }
}

impl Attrs {
    /// `(type of sys.modules, sys.modules[module].__dict__[name])` of an interpreter, `None`
    /// when the module is not imported or has no such global.
    pub(crate) fn module_global(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        interp: u64,
        module: &'static str,
        name: &'static str,
    ) -> Result<Option<(u64, u64)>, ObjectError> {
        let Some(modules_off) = o.interp_modules else {
            return Ok(None);
        };
        let modules = mem.read_u64(interp.wrapping_add(modules_off))?;
        if modules == 0 {
            return Ok(None);
        }
        let modules = object("sys.modules", modules)?;
        let dict_type = mem.read_u64(modules + 8)?;
        let Some(m) = self.lookup(mem, o, dict_items(mem, o, modules)?, module)? else {
            return Ok(None);
        };
        let md_dict = object(
            "module dict",
            mem.read_u64(object("module", m)? + MODULE_MD_DICT)?,
        )?;
        Ok(self
            .lookup(mem, o, dict_items(mem, o, md_dict)?, name)?
            .map(|v| (dict_type, v)))
    }

    /// The value of the str key `name` among `items`: by the interned key's address when it
    /// is known, else by reading keys of the right length.
    pub(crate) fn lookup(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        items: Vec<(u64, u64)>,
        name: &'static str,
    ) -> Result<Option<u64>, ObjectError> {
        if let Some(&k) = self.interned.get(name) {
            if let Some(&(_, v)) = items.iter().find(|(key, _)| *key == k) {
                return Ok(Some(v));
            }
        }
        for (key, value) in items {
            // The length first: one read rules out most keys.
            if mem.read_u64(key.wrapping_add(o.unicode_length)).ok() != Some(name.len() as u64) {
                continue;
            }
            if read_unicode(mem, o, key).is_ok_and(|s| s == name) {
                self.interned.insert(name, key);
                return Ok(Some(value));
            }
        }
        Ok(None)
    }

    /// An instance attribute that holds a str (`None` when absent).
    pub(crate) fn attribute_str(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        obj: u64,
        name: &'static str,
    ) -> Result<Option<String>, ObjectError> {
        match self.attribute(mem, o, obj, name)? {
            Some(v) => Ok(Some(read_unicode(mem, o, v)?)),
            None => Ok(None),
        }
    }

    /// The object an instance attribute refers to (`None` when absent or the instance has no
    /// dict).
    pub(crate) fn attribute(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        obj: u64,
        name: &'static str,
    ) -> Result<Option<u64>, ObjectError> {
        let obj = object("object", obj)?;
        let ty = object("type", mem.read_u64(obj + 8)?)?;
        let flags = mem.read_u64(ty + TYPE_FLAGS)?;
        // (dict, or (shared keys, values array)) of the instance.
        let items = match o.instance_dict {
            InstanceDict::DictOffset => {
                let off = mem.read_u64(ty + TYPE_DICTOFFSET)? as i64;
                if off <= 0 || off > 1 << 16 {
                    return Ok(None);
                }
                dict_items(mem, o, mem.read_u64(obj + off as u64)?)?
            }
            InstanceDict::Managed311 => {
                if flags & TPFLAGS_MANAGED_DICT == 0 {
                    return Ok(None);
                }
                let dict = mem.read_u64(obj.wrapping_sub(24))?;
                if dict != 0 {
                    dict_items(mem, o, dict)?
                } else {
                    let values = object("values", mem.read_u64(obj.wrapping_sub(32))?)?;
                    self.shared_items(mem, o, ty, values)?
                }
            }
            InstanceDict::Managed312 => {
                if flags & TPFLAGS_MANAGED_DICT == 0 {
                    return Ok(None);
                }
                let dorv = mem.read_u64(obj.wrapping_sub(24))?;
                if dorv & 1 == 1 {
                    let values = object("values", dorv.wrapping_add(1))?;
                    self.shared_items(mem, o, ty, values)?
                } else {
                    dict_items(mem, o, dorv)?
                }
            }
            InstanceDict::Inline313 => {
                let inline = flags & TPFLAGS_INLINE_VALUES != 0;
                let values = if inline {
                    let size = mem.read_u64(ty + TYPE_BASICSIZE)?;
                    if size == 0 || size > 1 << 16 {
                        return Err(garbage("type", ty, format!("tp_basicsize {size}")));
                    }
                    Some(obj + size)
                } else {
                    None
                };
                // PyDictValues: capacity, size, embedded, valid (u8 each).
                match values {
                    Some(v) if mem.read_u8(v + 3)? != 0 => self.shared_items(mem, o, ty, v)?,
                    _ if inline || flags & TPFLAGS_MANAGED_DICT != 0 => {
                        dict_items(mem, o, mem.read_u64(obj.wrapping_sub(24))?)?
                    }
                    _ => return Ok(None),
                }
            }
        };
        self.lookup(mem, o, items, name)
    }

    /// Items of an instance whose values are not in a dict: names from the class's shared
    /// keys (`ht_cached_keys`), values from `values`.
    fn shared_items(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        ty: u64,
        values: u64,
    ) -> Result<Vec<(u64, u64)>, ObjectError> {
        let Some(off) = o.heaptype_cached_keys else {
            return Ok(Vec::new());
        };
        let keys = object("shared keys", mem.read_u64(ty.wrapping_add(off))?)?;
        keys_items(mem, o, keys, Some(values))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cpython::memory::FakeMemory;
    use crate::cpython::offsets::{PY310, PY311, PY312};

    /// A tiny heap in fake memory for building CPython objects of one layout.
    pub(crate) struct Heap {
        pub mem: FakeMemory,
        pub next: u64,
        pub o: Offsets,
    }

    impl Heap {
        pub(crate) fn new(o: Offsets) -> Self {
            Heap {
                mem: FakeMemory::new(),
                next: 0x10_0000,
                o,
            }
        }
        pub(crate) fn put(&mut self, bytes: Vec<u8>) -> u64 {
            let at = self.next;
            self.next += (bytes.len() as u64 + 64 + 15) & !15;
            self.mem.map(at, bytes);
            at
        }
        pub(crate) fn words(words: &[u64]) -> Vec<u8> {
            words.iter().flat_map(|w| w.to_le_bytes()).collect()
        }
        pub(crate) fn str(&mut self, s: &str) -> u64 {
            let b = crate::cpython::objects::tests::ascii_str(&self.o, s);
            self.put(b)
        }
        pub(crate) fn int(&mut self, v: u64) -> u64 {
            let digits: Vec<u32> = (0..3)
                .map(|i| ((v >> (30 * i)) & ((1 << 30) - 1)) as u32)
                .collect();
            let n = digits.iter().rposition(|&d| d != 0).map_or(0, |i| i + 1) as u64;
            let head = if self.o.long_tagged { n << 3 } else { n };
            let mut b = Self::words(&[1, 0, head]);
            for d in &digits[..n as usize] {
                b.extend_from_slice(&d.to_le_bytes());
            }
            self.put(b)
        }
        /// Keys object holding `keys` (kind: 0 general with hashes, 1 unicode), values in the
        /// entries (or zero for split use).
        pub(crate) fn keys(&mut self, items: &[(u64, u64)], kind: u8) -> u64 {
            let mut b;
            match self.o.dict_keys {
                DictKeysLayout::Py310 => {
                    b = Self::words(&[1, 8, 0, 0, items.len() as u64]);
                    b.extend_from_slice(&[0xffu8; 8]);
                    for &(k, v) in items {
                        b.extend(Self::words(&[0, k, v]));
                    }
                }
                DictKeysLayout::Py311 { .. } => {
                    b = Self::words(&[1, 0, 0, items.len() as u64]);
                    b[8] = 3; // 8 slots
                    b[9] = 3; // 8 index bytes
                    b[10] = kind;
                    b.extend_from_slice(&[0xffu8; 8]);
                    for &(k, v) in items {
                        if kind == 0 {
                            b.extend(Self::words(&[0, k, v]));
                        } else {
                            b.extend(Self::words(&[k, v]));
                        }
                    }
                }
            }
            self.put(b)
        }
        pub(crate) fn dict(&mut self, ty: u64, items: &[(u64, u64)], kind: u8) -> u64 {
            let keys = self.keys(items, kind);
            self.put(Self::words(&[1, ty, items.len() as u64, 0, keys, 0]))
        }
    }

    /// `sys.modules` with `threading`, whose `_active` has two threads (one with a
    /// non-ASCII-free long name), the Thread objects laid out as `o` says.
    fn process(o: Offsets) -> (Heap, u64, Vec<(u64, &'static str)>) {
        let mut h = Heap::new(o.clone());
        let dict_type = h.put(vec![0u8; 512]);
        let thread_type = h.put(vec![0u8; 1024]);
        let names = vec![
            (0x7f00_1234_5000u64, "MainThread"),
            (0x7f00_1234_9000u64, "vllm-aux-output-writer"),
        ];
        let k_name = h.str("_name");
        let k_ident = h.str("_ident");
        let mut active = Vec::new();
        for &(ident, name) in &names {
            let v_name = h.str(name);
            let v_ident = h.int(ident);
            let attrs = [(k_ident, v_ident), (k_name, v_name)];
            let obj = match o.instance_dict {
                InstanceDict::DictOffset => {
                    let d = h.dict(dict_type, &attrs, 1);
                    h.put(Heap::words(&[1, thread_type, d, 0]))
                }
                InstanceDict::Managed311 | InstanceDict::Managed312 => {
                    let values = h.put(Heap::words(&[v_ident, v_name]));
                    // The pre-header (3.11: values, dict; 3.12: -, dict-or-values), the GC
                    // header, then the object.
                    let pre = if o.instance_dict == InstanceDict::Managed311 {
                        Heap::words(&[values, 0, 0, 0, 1, thread_type])
                    } else {
                        Heap::words(&[0, values - 1, 0, 0, 1, thread_type])
                    };
                    h.put(pre) + 32
                }
                InstanceDict::Inline313 => {
                    let mut b = Heap::words(&[0, 0, 0, 1, thread_type]);
                    b.extend_from_slice(&[2, 2, 1, 1, 0, 0, 0, 0]);
                    b.extend(Heap::words(&[v_ident, v_name]));
                    h.put(b) + 24
                }
            };
            active.push((h.int(ident), obj));
        }
        // The class: flags, basicsize 16 (3.13+ inline values follow the 16-byte header),
        // dictoffset 16 (3.10), shared keys.
        let shared = h.keys(&[(k_ident, 0), (k_name, 0)], 2);
        let mut t = vec![0u8; 1024];
        let flags = TPFLAGS_MANAGED_DICT | TPFLAGS_INLINE_VALUES;
        t[TYPE_FLAGS as usize..TYPE_FLAGS as usize + 8].copy_from_slice(&flags.to_le_bytes());
        t[TYPE_BASICSIZE as usize..TYPE_BASICSIZE as usize + 8]
            .copy_from_slice(&16u64.to_le_bytes());
        t[TYPE_DICTOFFSET as usize..TYPE_DICTOFFSET as usize + 8]
            .copy_from_slice(&16u64.to_le_bytes());
        if let Some(ck) = o.heaptype_cached_keys {
            t[ck as usize..ck as usize + 8].copy_from_slice(&shared.to_le_bytes());
        }
        h.mem.map(thread_type, t);
        let active = h.dict(dict_type, &active, 0);
        let k_active = h.str("_active");
        let k_other = h.str("_activf");
        let md = h.dict(dict_type, &[(k_other, 8), (k_active, active)], 1);
        let module = h.put(Heap::words(&[1, 0, md]));
        let k_threading = h.str("threading");
        let k_sys = h.str("sys");
        let modules = h.dict(dict_type, &[(k_sys, 8), (k_threading, module)], 1);
        let mut interp = vec![0u8; 8192];
        let off = o.interp_modules.unwrap() as usize;
        interp[off..off + 8].copy_from_slice(&modules.to_le_bytes());
        let interp_at = h.put(interp);
        (h, interp_at, names)
    }

    #[test]
    fn names_by_ident_in_every_layout() {
        let mut o313 = PY312;
        o313.instance_dict = InstanceDict::Inline313;
        o313.dict_keys = DictKeysLayout::Py311 { values_at: 8 };
        for o in [PY310, PY311, PY312, o313] {
            let (h, interp, names) = process(o.clone());
            let mut r = ThreadNames::default();
            let got = r.read(&h.mem, &o, interp).unwrap();
            let want: HashMap<u64, String> =
                names.iter().map(|&(i, n)| (i, n.to_string())).collect();
            assert_eq!(got, want, "{:?}", o.instance_dict);
            // Again from the cached `_active` and interned keys.
            assert_eq!(r.read(&h.mem, &o, interp).unwrap(), want);
            assert_eq!(r.misses, 0);
        }
    }

    #[test]
    fn no_threading_module_is_no_names() {
        let o = PY312;
        let mut h = Heap::new(o.clone());
        let dict_type = h.put(vec![0u8; 64]);
        let k = h.str("sys");
        let modules = h.dict(dict_type, &[(k, 8)], 1);
        let mut interp = vec![0u8; 2048];
        let off = o.interp_modules.unwrap() as usize;
        interp[off..off + 8].copy_from_slice(&modules.to_le_bytes());
        let at = h.put(interp);
        let mut r = ThreadNames::default();
        assert!(r.read(&h.mem, &o, at).unwrap().is_empty());
        assert_eq!(r.misses, 1);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        // Pseudo-random words that often point back into the regions, read as every layout.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..200 {
            let mut mem = FakeMemory::new();
            let bases: Vec<u64> = (0..8).map(|i| 0x200_0000 + i * 0x2000).collect();
            for &b in &bases {
                let mut bytes = Vec::with_capacity(8192);
                for _ in 0..1024 {
                    let r = rnd();
                    let w = if r % 3 == 0 {
                        bases[(r >> 8) as usize % bases.len()] + (((r >> 20) % 8000) & !7)
                    } else if r % 3 == 1 {
                        r & 0xff
                    } else {
                        r
                    };
                    bytes.extend_from_slice(&w.to_le_bytes());
                }
                mem.map(b, bytes);
            }
            let o = [PY310, PY311, PY312][round % 3].clone();
            let mut r = ThreadNames::default();
            let _ = r.read(&mem, &o, bases[round % bases.len()]);
            let _ = dict_items(&mem, &o, bases[(round + 1) % bases.len()]);
        }
    }

    #[test]
    fn ints() {
        for o in [PY311, PY312] {
            let mut h = Heap::new(o.clone());
            for v in [0u64, 1, 1 << 30, 0x7f12_3456_7000, u64::MAX] {
                let a = h.int(v);
                assert_eq!(read_u64_int(&h.mem, &o, a).unwrap(), v);
            }
        }
    }
}
