//! `seedgen PID OUT`: attach to PID, snapshot every thread, and write every region of target
//! memory the reader touched (plus `_Py_DebugOffsets` on 3.13+) as a fuzz/src/fakeproc.rs input.
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use enginescope::cpython::memory::{MemorySource, ProcessMemory, ReadError};
use enginescope::cpython::PythonProcess;

#[path = "../../src/fakeproc.rs"]
mod fakeproc;

struct Recorder {
    inner: ProcessMemory,
    reads: Rc<RefCell<BTreeMap<u64, Vec<u8>>>>,
}

impl MemorySource for Recorder {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        self.inner.read(addr, buf)?;
        let mut r = self.reads.borrow_mut();
        let e = r.entry(addr).or_default();
        if e.len() < buf.len() {
            *e = buf.to_vec();
        }
        Ok(())
    }
}

/// Merge overlapping and adjacent reads into regions.
fn regions(reads: &BTreeMap<u64, Vec<u8>>) -> Vec<(u64, Vec<u8>)> {
    let mut out: Vec<(u64, Vec<u8>)> = Vec::new();
    for (&a, b) in reads {
        if let Some((start, bytes)) = out.last_mut() {
            let end = *start + bytes.len() as u64;
            if a <= end {
                let skip = (end - a) as usize;
                if skip < b.len() {
                    bytes.extend_from_slice(&b[skip..]);
                }
                continue;
            }
        }
        out.push((a, b.clone()));
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(pid), Some(out)) = (args.get(1).and_then(|p| p.parse().ok()), args.get(2)) else {
        eprintln!("usage: seedgen PID OUT");
        std::process::exit(2);
    };
    let p = PythonProcess::attach(pid).expect("attach");
    let reads = Rc::new(RefCell::new(BTreeMap::new()));
    let rec = Recorder {
        inner: ProcessMemory::open(pid).expect("open memory"),
        reads: reads.clone(),
    };
    if p.version.minor >= 13 {
        let _ = enginescope::cpython::offsets::read_debug_offsets(
            &rec,
            p.binary.runtime_addr,
            Some(p.version),
        );
    }
    let code_type = p.binary.symbols.get("PyCode_Type").copied().unwrap_or(0);
    let (runtime, version, offsets, mut binary) = (
        p.binary.runtime_addr,
        p.version,
        p.offsets.clone(),
        p.binary.clone(),
    );
    binary.bss = None;
    let q = PythonProcess::from_parts(pid, Box::new(rec), binary, version, offsets);
    let snap = q.snapshot().expect("snapshot");
    eprintln!(
        "{} threads, {} frames",
        snap.threads.len(),
        snap.threads.iter().map(|t| t.frames.len()).sum::<usize>()
    );
    let regs = regions(&reads.borrow());
    let bytes = fakeproc::encode(version.minor, runtime, code_type, &regs);
    eprintln!("{} regions, {} bytes", regs.len(), bytes.len());
    std::fs::write(out, bytes).expect("write");
}
