//! Names of the C functions behind builtins, read from the interpreter: for a stripped
//! interpreter (Debian's static `python3.X`) or an extension module with no symbol for its
//! local functions, a native frame in `_pickle_dumps` is only an address in a binary. But
//! the interpreter knows it: `pickle.dumps` is a `builtin_function_or_method` whose
//! `PyMethodDef.ml_meth` is that very address, and a C type's `tp_call` and `tp_methods`
//! name the functions its instances call (`_json.Encoder.__call__`, `list.sort`).
//!
//! [`BuiltinScan::scan`] walks `sys.modules`: each C module (one with a `PyModuleDef`;
//! modules of Python code are skipped, since the builtins they hold are re-exports), its
//! `m_methods`, the builtin functions in its dict, and each type in it once (its `tp_call`
//! and `tp_methods`). It returns the
//! `(function address, "module.name")` pairs it has not returned before. Modules whose dict
//! did not change since the last scan (same dict, same `ma_used`) are skipped, so a rescan
//! costs a few reads per module. An address that two different names claim (a generic slot
//! function shared by many types, such as `slot_tp_call`) is ambiguous and never named.
//!
//! Bounded and checked like every other read of the target: dicts through
//! [`dict_items`]'s bounds, at most [`MAX_METHODS`] method entries per type, names of at
//! most [`MAX_NAME`] bytes, at most [`MAX_FUNCTIONS`] names in all.

use std::collections::{HashMap, HashSet};

use super::memory::MemorySource;
use super::objects::{read_unicode, ObjectError};
use super::offsets::{Offsets, MODULE_MD_DICT, TYPE_FLAGS};
use super::threading::{dict_items, garbage, object};

/// `PyTypeObject.tp_name` (cpython/object.h), 3.10–3.15: after `PyObject_VAR_HEAD`.
const TYPE_NAME: u64 = 24;
/// `PyTypeObject.tp_call`.
const TYPE_CALL: u64 = 128;
/// `PyTypeObject.tp_methods`.
const TYPE_METHODS: u64 = 232;
/// `Py_TPFLAGS_TYPE_SUBCLASS`: the object's type is `type` or a metaclass, so it is a type.
const TPFLAGS_TYPE_SUBCLASS: u64 = 1 << 31;
/// `PyCFunctionObject.m_ml` (cpython/methodobject.h), 3.10–3.15: after `PyObject_HEAD`.
const CFUNCTION_ML: u64 = 16;
/// `PyCFunctionObject.m_module`: the defining module's name (a str), or NULL.
const CFUNCTION_MODULE: u64 = 32;
/// `sizeof(PyMethodDef)`: `ml_name`, `ml_meth`, `ml_flags` (padded), `ml_doc`.
const METHOD_DEF: u64 = 32;
/// `PyModuleDef.m_name` (moduleobject.h), 3.10–3.15: after the 40-byte `PyModuleDef_Base`.
const MODULEDEF_NAME: u64 = 40;
/// `PyModuleDef.m_methods`.
const MODULEDEF_METHODS: u64 = 64;
/// `PyDictObject.ma_used`.
const DICT_MA_USED: u64 = 16;

/// Most method entries read from one type's `tp_methods` (CPython's largest, `str`, has ~50).
pub(crate) const MAX_METHODS: u64 = 1024;
/// Longest C name read (`ml_name`, `tp_name`).
pub(crate) const MAX_NAME: usize = 128;
/// Most function names kept per process.
pub const MAX_FUNCTIONS: usize = 1 << 18;
/// Most modules of `sys.modules` read per scan.
pub(crate) const MAX_MODULES: usize = 1 << 14;

/// What an object's type makes it, for the scan.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Module,
    Builtin,
    Type,
    Other,
}

/// The scan's memory between calls.
#[derive(Default)]
pub struct BuiltinScan {
    /// Module object → (its dict, the dict's `ma_used`) when last read.
    modules: HashMap<u64, (u64, u64)>,
    /// Type objects read (their `tp_call`/`tp_methods`).
    types: HashSet<u64>,
    /// Kind of each type met (by the type's address).
    kinds: HashMap<u64, Kind>,
    /// Function address → name (`None`: claimed by two names).
    names: HashMap<u64, Option<String>>,
    /// Objects that could not be read (counted, skipped).
    pub errors: u64,
}

impl BuiltinScan {
    /// Read the interpreter's modules and return the functions named for the first time
    /// since the last scan (an address later found ambiguous is returned again with `None`).
    pub fn scan(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        interp: u64,
    ) -> Result<Vec<(u64, Option<String>)>, ObjectError> {
        let Some(modules_off) = o.interp_modules else {
            return Ok(Vec::new());
        };
        let modules = mem.read_u64(interp.wrapping_add(modules_off))?;
        if modules == 0 {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for (key, module) in dict_items(mem, o, object("sys.modules", modules)?)?
            .into_iter()
            .take(MAX_MODULES)
        {
            if let Err(_e) = self.scan_module(mem, o, key, module, &mut out) {
                self.errors += 1;
            }
        }
        Ok(out)
    }

    fn scan_module(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        key: u64,
        module: u64,
        out: &mut Vec<(u64, Option<String>)>,
    ) -> Result<(), ObjectError> {
        if self.kind(mem, module)? != Kind::Module {
            return Ok(());
        }
        if self.modules.get(&module) == Some(&(0, 0)) {
            return Ok(());
        }
        let head = mem.read_vec(module + MODULE_MD_DICT, 16)?;
        let def = word(&head, 8);
        if def == 0 {
            // A module of Python code (no PyModuleDef): the builtins its dict holds are
            // another module's (`pickle.dumps` is `_pickle`'s), named there. Most of a large
            // application's modules are these; skipping them keeps a scan to the C modules.
            if self.modules.len() < MAX_MODULES {
                self.modules.insert(module, (0, 0));
            }
            return Ok(());
        }
        let dict = object("module dict", word(&head, 0))?;
        let used = mem.read_u64(dict + DICT_MA_USED)?;
        if self.modules.get(&module) == Some(&(dict, used)) {
            return Ok(());
        }
        let def = object("PyModuleDef", def)?;
        let name = match read_cstr(mem, mem.read_u64(def + MODULEDEF_NAME)?) {
            Ok(n) => n,
            Err(_) => read_unicode(mem, o, key)?,
        };
        // The module's own functions (`m_methods`), then what its dict holds: functions
        // added at init (`PyModule_AddFunctions`) and its types.
        let methods = mem.read_u64(def + MODULEDEF_METHODS)?;
        if methods != 0 && self.method_table(mem, &name, methods, out).is_err() {
            self.errors += 1;
        }
        for (_, value) in dict_items(mem, o, dict)? {
            let r = match self.kind(mem, value) {
                Ok(Kind::Builtin) => self.builtin(mem, o, &name, value, out),
                Ok(Kind::Type) => self.type_functions(mem, value, out),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            if r.is_err() {
                self.errors += 1;
            }
        }
        if self.modules.len() < MAX_MODULES {
            self.modules.insert(module, (dict, used));
        }
        Ok(())
    }

    /// What `obj` is, by its type (cached per type).
    fn kind(&mut self, mem: &dyn MemorySource, obj: u64) -> Result<Kind, ObjectError> {
        let ty = object("type", mem.read_u64(object("object", obj)? + 8)?)?;
        if let Some(&k) = self.kinds.get(&ty) {
            return Ok(k);
        }
        let flags = mem.read_u64(ty + TYPE_FLAGS)?;
        let k = if flags & TPFLAGS_TYPE_SUBCLASS != 0 {
            Kind::Type
        } else {
            match read_cstr(mem, mem.read_u64(ty + TYPE_NAME)?)?.as_str() {
                "module" => Kind::Module,
                "builtin_function_or_method" => Kind::Builtin,
                _ => Kind::Other,
            }
        };
        if self.kinds.len() < MAX_FUNCTIONS {
            self.kinds.insert(ty, k);
        }
        Ok(k)
    }

    /// A builtin function of module `module`: its `ml_meth` is `module.ml_name`.
    fn builtin(
        &mut self,
        mem: &dyn MemorySource,
        o: &Offsets,
        module: &str,
        f: u64,
        out: &mut Vec<(u64, Option<String>)>,
    ) -> Result<(), ObjectError> {
        let head = mem.read_vec(f + CFUNCTION_ML, 24)?;
        let ml = object("PyMethodDef", word(&head, 0))?;
        let def = mem.read_vec(ml, 16)?;
        let (name_at, meth) = (word(&def, 0), word(&def, 8));
        let name = read_cstr(mem, name_at)?;
        // The function's own module (`m_module`, `__module__`): `pickle.dumps` is
        // `_pickle.dumps` re-exported, one C function under one name.
        let own = match word(&head, CFUNCTION_MODULE - CFUNCTION_ML) {
            0 => None,
            m => read_unicode(mem, o, m).ok(),
        };
        self.add(
            meth,
            format!("{}.{name}", own.as_deref().unwrap_or(module)),
            out,
        );
        Ok(())
    }

    /// A type, once: `tp_call` as `T.__call__` and each `tp_methods` entry as `T.name`.
    fn type_functions(
        &mut self,
        mem: &dyn MemorySource,
        ty: u64,
        out: &mut Vec<(u64, Option<String>)>,
    ) -> Result<(), ObjectError> {
        if !self.types.insert(ty) {
            return Ok(());
        }
        let head = mem.read_vec(ty, (TYPE_METHODS + 8) as usize)?;
        let tp_name = read_cstr(mem, word(&head, TYPE_NAME))?;
        let call = word(&head, TYPE_CALL);
        if call != 0 {
            self.add(call, format!("{tp_name}.__call__"), out);
        }
        let methods = word(&head, TYPE_METHODS);
        if methods == 0 {
            return Ok(());
        }
        self.method_table(mem, &tp_name, methods, out)
    }

    /// A NULL-terminated `PyMethodDef` table (`tp_methods`, `m_methods`): `prefix.name`.
    fn method_table(
        &mut self,
        mem: &dyn MemorySource,
        tp_name: &str,
        methods: u64,
        out: &mut Vec<(u64, Option<String>)>,
    ) -> Result<(), ObjectError> {
        let methods = object("PyMethodDef table", methods)?;
        // In pages of 32 entries: most tables have a few.
        let mut i = 0;
        while i < MAX_METHODS {
            let n = 32.min(MAX_METHODS - i);
            let Ok(page) = mem.read_vec(
                methods.wrapping_add(i * METHOD_DEF),
                (n * METHOD_DEF) as usize,
            ) else {
                // The table may end just before an unmapped page: read it one entry at a
                // time from here.
                let def =
                    mem.read_vec(methods.wrapping_add(i * METHOD_DEF), METHOD_DEF as usize)?;
                if word(&def, 0) == 0 {
                    return Ok(());
                }
                self.method(mem, tp_name, &def, out)?;
                i += 1;
                continue;
            };
            for e in page.chunks_exact(METHOD_DEF as usize) {
                if word(e, 0) == 0 {
                    return Ok(());
                }
                self.method(mem, tp_name, e, out)?;
            }
            i += n;
        }
        Err(garbage("tp_methods", methods, "no end of table"))
    }

    fn method(
        &mut self,
        mem: &dyn MemorySource,
        tp_name: &str,
        def: &[u8],
        out: &mut Vec<(u64, Option<String>)>,
    ) -> Result<(), ObjectError> {
        let name = read_cstr(mem, word(def, 0))?;
        self.add(word(def, 8), format!("{tp_name}.{name}"), out);
        Ok(())
    }

    fn add(&mut self, addr: u64, name: String, out: &mut Vec<(u64, Option<String>)>) {
        if addr == 0 {
            return;
        }
        match self.names.get_mut(&addr) {
            Some(None) => {}
            Some(Some(old)) => {
                if *old != name {
                    self.names.insert(addr, None);
                    out.push((addr, None));
                }
            }
            None => {
                if self.names.len() < MAX_FUNCTIONS {
                    self.names.insert(addr, Some(name.clone()));
                    out.push((addr, Some(name)));
                }
            }
        }
    }
}

fn word(b: &[u8], at: u64) -> u64 {
    let at = at as usize;
    b.get(at..at + 8)
        .and_then(|x| x.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// A NUL-terminated C identifier (`ml_name`, `tp_name`) of at most [`MAX_NAME`] bytes:
/// printable ASCII, else garbage.
fn read_cstr(mem: &dyn MemorySource, addr: u64) -> Result<String, ObjectError> {
    if addr == 0 || addr >= 1 << 57 {
        return Err(garbage("C string", addr, "not an address"));
    }
    // Read up to the end of the page first (the next one may be unmapped), then the rest.
    let to_page_end = (0x1000 - (addr & 0xfff)) as usize;
    let first = to_page_end.min(MAX_NAME);
    let mut bytes = mem.read_vec(addr, first)?;
    if !bytes.contains(&0) && first < MAX_NAME {
        if let Ok(more) = mem.read_vec(addr + first as u64, MAX_NAME - first) {
            bytes.extend(more);
        }
    }
    let end = bytes
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| garbage("C string", addr, "no NUL"))?;
    let s = &bytes[..end];
    if s.is_empty() || !s.iter().all(|&b| b.is_ascii_graphic()) {
        return Err(garbage("C string", addr, "not a C identifier"));
    }
    Ok(String::from_utf8_lossy(s).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpython::memory::FakeMemory;
    use crate::cpython::offsets::PY312;
    use crate::cpython::threading::tests::Heap;

    /// A fake interpreter whose `sys.modules` holds the C module `_pickle` (`m_methods`:
    /// `dumps`; its dict: a type `Pickler` with `tp_call` and two methods, and a builtin
    /// `extra` added at init) and the Python module `pickle`, whose dict re-exports a builtin
    /// under another name (never read: Python modules are skipped).
    fn process() -> (Heap, u64) {
        let o = PY312;
        let mut h = Heap::new(o.clone());
        let cstr = |h: &mut Heap, s: &str| {
            // Padded: the reader reads up to MAX_NAME bytes at once, as a page allows.
            let mut b = s.as_bytes().to_vec();
            b.resize(MAX_NAME, 0);
            h.put(b)
        };
        let put = |b: &mut Vec<u8>, at: u64, v: u64| {
            b[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes())
        };
        // `type` (a metatype: flags with TYPE_SUBCLASS), `module`, builtins.
        let mut type_obj = vec![0u8; 240];
        put(&mut type_obj, TYPE_FLAGS, TPFLAGS_TYPE_SUBCLASS);
        let type_type = h.put(type_obj);
        let named_type = |h: &mut Heap, name: &str| {
            let n = cstr(h, name);
            let mut t = vec![0u8; 240];
            put(&mut t, TYPE_NAME, n);
            h.put(t)
        };
        let module_type = named_type(&mut h, "module");
        let builtin_type = named_type(&mut h, "builtin_function_or_method");
        // PyModuleDef of _pickle: m_name, m_methods = [dumps -> 0x4000_1000].
        let dumps = cstr(&mut h, "dumps");
        let m_methods = h.put(Heap::words(&[dumps, 0x4000_1000, 0, 0, 0, 0, 0, 0]));
        let m_name = cstr(&mut h, "_pickle");
        let mut def = vec![0u8; 128];
        put(&mut def, MODULEDEF_NAME, m_name);
        put(&mut def, MODULEDEF_METHODS, m_methods);
        let def = h.put(def);
        // A builtin added at init: `extra` -> 0x4000_4000, m_module NULL.
        let extra = cstr(&mut h, "extra");
        let extra_def = h.put(Heap::words(&[extra, 0x4000_4000, 0, 0]));
        let extra_f = h.put(Heap::words(&[1, builtin_type, extra_def, 0, 0, 0]));
        // class Pickler: tp_call 0x4000_2000; methods dump (0x4000_3000), clear_memo
        // (0x4000_1000: the address of dumps, so ambiguous).
        let (dump, clear) = (cstr(&mut h, "dump"), cstr(&mut h, "clear_memo"));
        let methods = h.put(Heap::words(&[
            dump,
            0x4000_3000,
            0,
            0,
            clear,
            0x4000_1000,
            0,
            0,
            0,
            0,
            0,
            0,
        ]));
        let pname = cstr(&mut h, "_pickle.Pickler");
        let mut pickler = vec![0u8; 240];
        put(&mut pickler, 8, type_type);
        put(&mut pickler, TYPE_NAME, pname);
        put(&mut pickler, TYPE_CALL, 0x4000_2000);
        put(&mut pickler, TYPE_METHODS, methods);
        let pickler = h.put(pickler);
        let dict_type = h.put(vec![0u8; 240]);
        let (k_extra, k_pickler) = (h.str("extra"), h.str("Pickler"));
        let md = h.dict(dict_type, &[(k_extra, extra_f), (k_pickler, pickler)], 1);
        let c_module = h.put(Heap::words(&[1, module_type, md, def, 0]));
        // pickle (Python code, no PyModuleDef): `loads` -> 0x4000_5000, never named.
        let loads = cstr(&mut h, "loads");
        let loads_def = h.put(Heap::words(&[loads, 0x4000_5000, 0, 0]));
        let loads_f = h.put(Heap::words(&[1, builtin_type, loads_def, 0, 0, 0]));
        let k_loads = h.str("loads");
        let py_md = h.dict(dict_type, &[(k_loads, loads_f)], 1);
        let py_module = h.put(Heap::words(&[1, module_type, py_md, 0, 0]));
        let (k_c, k_py) = (h.str("_pickle"), h.str("pickle"));
        let modules = h.dict(dict_type, &[(k_c, c_module), (k_py, py_module)], 1);
        let interp = h.put(vec![0u8; 2048]);
        h.mem.put_u64(
            interp + o.interp_modules.expect("3.12 has modules"),
            modules,
        );
        (h, interp)
    }

    #[test]
    fn names_c_modules_functions_and_types_once() {
        let (h, interp) = process();
        let mut s = BuiltinScan::default();
        let mut got = s.scan(&h.mem, &PY312, interp).unwrap();
        got.sort();
        assert_eq!(
            got,
            vec![
                (0x4000_1000, None),
                (0x4000_1000, Some("_pickle.dumps".to_string())),
                (0x4000_2000, Some("_pickle.Pickler.__call__".to_string())),
                (0x4000_3000, Some("_pickle.Pickler.dump".to_string())),
                (0x4000_4000, Some("_pickle.extra".to_string())),
            ]
        );
        // Nothing changed: nothing new.
        assert!(s.scan(&h.mem, &PY312, interp).unwrap().is_empty());
        assert_eq!(s.errors, 0);
    }

    #[test]
    fn garbage_is_counted_not_a_panic() {
        let (h, interp) = process();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..300 {
            let mut mem: FakeMemory = h.mem.clone();
            for _ in 0..8 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let at = (0x10_0000 + rng % (h.next - 0x10_0000 - 8)) & !7;
                if mem.read_u64(at).is_ok() {
                    mem.put_u64(at, rng.rotate_left(17));
                }
            }
            let mut s = BuiltinScan::default();
            let _ = s.scan(&mem, &PY312, interp);
        }
    }
}
