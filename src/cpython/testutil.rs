//! Fake CPython processes in fake memory, for unit tests of the walker and the sampler.

use std::collections::HashMap;

use super::binary::InterpreterBinary;
use super::memory::FakeMemory;
use super::offsets::PY312;
use super::reader::PythonProcess;
use super::version::PyVersion;

pub(crate) const RUNTIME: u64 = 0x10_0000;
pub(crate) const INTERP: u64 = 0x20_0000;
pub(crate) const CODE_TYPE: u64 = 0x30_0000;

/// A fake 3.12 process: one interpreter, threads with frames made of code objects.
pub(crate) struct Fake {
    pub mem: FakeMemory,
    next: u64,
}

impl Default for Fake {
    fn default() -> Self {
        Self::new()
    }
}

impl Fake {
    pub fn new() -> Self {
        let mut mem = FakeMemory::new();
        mem.map(RUNTIME, vec![0; 4096]);
        mem.map(INTERP, vec![0; 4096]);
        mem.map(CODE_TYPE, vec![0; 64]);
        mem.put_u64(RUNTIME + PY312.runtime_interpreters_head, INTERP);
        Fake {
            mem,
            next: 0x100_0000,
        }
    }
    pub(crate) fn alloc(&mut self, size: usize) -> u64 {
        let a = self.next;
        self.mem.map(a, vec![0; size]);
        self.next += 0x1_0000;
        a
    }
    pub fn str(&mut self, s: &str) -> u64 {
        let o = &PY312;
        let a = self.alloc(64 + s.len());
        self.mem.put_u64(a + o.unicode_length, s.len() as u64);
        self.mem
            .put_u32(a + o.unicode_state, (1 << 2) | (1 << 5) | (1 << 6));
        self.mem.put(a + o.unicode_ascii_size, s.as_bytes());
        a
    }
    /// A code object whose every instruction is on `line`.
    pub fn code(&mut self, name: &str, line: i32) -> u64 {
        let o = &PY312;
        let a = self.alloc(512);
        let n = self.str(name);
        let f = self.str("fake.py");
        // linetable: one no-column entry of 8 code units, line delta +0.
        let lt = self.alloc(64);
        self.mem.put_u64(lt + o.bytes_size, 2);
        self.mem.put(lt + o.bytes_data, &[0x80 | (13 << 3) | 7, 0]);
        self.mem.put_u64(a + 8, CODE_TYPE);
        self.mem.put_u64(a + o.code_name, n);
        self.mem.put_u64(a + o.code_qualname.unwrap(), n);
        self.mem.put_u64(a + o.code_filename, f);
        self.mem.put_u64(a + o.code_linetable, lt);
        self.mem.put_u32(a + o.code_firstlineno, line as u32);
        a
    }
    pub fn frame(&mut self, code: u64, previous: u64, owner: u8) -> u64 {
        let o = &PY312;
        let a = self.alloc(128);
        self.mem.put_u64(a + o.frame_code, code);
        self.mem.put_u64(a + o.frame_previous, previous);
        self.mem
            .put_u64(a + o.frame_instr, code + o.code_code_adaptive.unwrap() + 4);
        self.mem.put(a + o.frame_owner.unwrap(), &[owner]);
        a
    }
    pub fn thread(&mut self, top_frame: u64, next: u64) -> u64 {
        let o = &PY312;
        let t = self.alloc(512);
        let cframe = self.alloc(64);
        self.mem
            .put_u64(cframe + o.cframe_current_frame.unwrap(), top_frame);
        self.mem.put_u64(t + o.tstate_frame, cframe);
        self.mem.put_u64(t + o.tstate_next, next);
        t
    }
    pub fn process(self, head: u64) -> PythonProcess {
        let mut mem = self.mem;
        mem.put_u64(INTERP + PY312.interp_threads_head, head);
        let mut symbols = HashMap::new();
        symbols.insert("PyCode_Type".to_string(), CODE_TYPE);
        let binary = InterpreterBinary {
            path: "fake".into(),
            opened_from: "fake".into(),
            is_shared_lib: false,
            pie: false,
            stripped: true,
            build_id: None,
            bias: 0,
            runtime_addr: RUNTIME,
            runtime_found_by: "test".into(),
            symbols,
            bss: None,
        };
        PythonProcess::from_parts(1, Box::new(mem), binary, PyVersion::new(3, 12, 1), PY312)
    }
}
