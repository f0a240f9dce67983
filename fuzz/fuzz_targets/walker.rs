//! The CPython frame/thread/code-object walker over fake memory built from the input
//! (fuzz/src/fakeproc.rs): interpreters, thread states, frames, code objects, strings, line
//! tables, the GIL and GC state, the 3.10 pthread tid search, Python thread names (`threading`)
//! and asyncio's running tasks (dict and object walks), and the exact-probe planner's bytecode
//! read, all through `MemorySource` on untrusted bytes.
#![no_main]

use std::collections::HashMap;

use enginescope::cpython::asyncio::{parse_asyncio_debug, AsyncioTasks};
use enginescope::cpython::binary::InterpreterBinary;
use enginescope::cpython::objects::read_code;
use enginescope::cpython::offsets::{read_debug_offsets, Offsets};
use enginescope::cpython::reader::detect_version;
use enginescope::cpython::symbols::Symbolizer;
use enginescope::cpython::threading::ThreadNames;
use enginescope::cpython::version::PyVersion;
use enginescope::cpython::PythonProcess;
use enginescope::procinfo::TaskInfo;
use enginescope_fuzz::fakeproc;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(fp) = fakeproc::decode(data) else {
        return;
    };
    let minor = if (10..=15).contains(&fp.minor) {
        fp.minor
    } else {
        10 + fp.minor % 6
    };
    let (version, offsets) = if minor >= 13 {
        match read_debug_offsets(&fp.mem, fp.runtime_addr, None) {
            Ok((v, _, o)) => (v, o),
            Err(_) => return,
        }
    } else {
        let v = PyVersion::new(3, minor, 0);
        match Offsets::static_table(v) {
            Some(o) => (v, o),
            None => return,
        }
    };
    let mut symbols = HashMap::new();
    if fp.code_type != 0 {
        symbols.insert("PyCode_Type".to_string(), fp.code_type);
    }
    let binary = InterpreterBinary {
        path: "fuzz".into(),
        opened_from: "fuzz".into(),
        is_shared_lib: false,
        pie: false,
        stripped: true,
        build_id: None,
        bias: 0,
        runtime_addr: fp.runtime_addr,
        runtime_found_by: "fuzz".into(),
        symbols,
        // The 3.10 version-string scan reads .bss: point it at the runtime's neighbourhood.
        bss: Some((fp.runtime_addr, fp.runtime_addr.wrapping_add(1 << 16))),
    };
    let _ = detect_version(&fp.mem, &binary);
    // Region starts are where objects are likely to be: plan exact probes and read code there.
    let starts = fp.starts.clone();
    let p = PythonProcess::from_parts(1, Box::new(fp.mem), binary, version, offsets);
    let tasks: Vec<TaskInfo> = (1..=4)
        .map(|n| TaskInfo {
            host_tid: 100 + n,
            ns_tid: n,
            comm: format!("t{n}"),
        })
        .collect();
    if let Ok(snap) = p.snapshot_with_tasks(&tasks) {
        assert!(snap.threads.len() <= enginescope::cpython::reader::MAX_THREADS * 64);
        for t in &snap.threads {
            assert!(t.frames.len() <= enginescope::cpython::reader::MAX_FRAMES);
        }
    }
    let _ = p.threads_with_tids(&tasks);
    if let Ok(interp) = p.main_interpreter() {
        let _ = p.gil_holder(interp);
        let _ = p.gc_collecting(interp);
        if let Ok(ts) = p.thread_states(interp) {
            let mut sym = Symbolizer::new();
            for &t in ts.iter().take(8) {
                let (raw, _) = p.walk_raw(t);
                let frames = sym.resolve(p.mem.as_ref(), &p.offsets, &raw);
                assert!(frames.len() <= raw.len());
            }
            // Builtin function names for native frames with no symbol: every module dict in
            // `sys.modules`, builtins' PyMethodDef, types' tp_call/tp_methods.
            let mut scan = enginescope::cpython::builtins::BuiltinScan::default();
            if let Ok(found) = scan.scan(p.mem.as_ref(), &p.offsets, interp) {
                assert!(found.len() <= 2 * enginescope::cpython::builtins::MAX_FUNCTIONS);
            }
            // Python thread names: `sys.modules` → `threading._active`, dict walks.
            let _ = p.python_thread_names(&mut ThreadNames::default());
            // asyncio's running tasks: 3.10–3.13 through `asyncio.tasks._current_tasks` and
            // the loops' attributes, 3.14+ through the `.AsyncioDebug` offsets (taken from
            // the input here: looking for them reads the real /proc/PID/maps).
            let mut at = AsyncioTasks::default();
            at.debug = parse_asyncio_debug(data.get(..104).unwrap_or(data));
            if p.version.minor < 14 || at.debug.is_some() {
                let running = p.running_tasks(&mut at, &ts);
                for (&t, &task) in running.iter().take(8) {
                    if let Some(r) = p.describe_running_task(&mut at, &mut sym, t, task) {
                        assert!(r.chain.len() <= enginescope::cpython::asyncio::MAX_CHAIN);
                    }
                }
            }
        }
    }
    for &a in starts.iter().take(8) {
        let _ = read_code(p.mem.as_ref(), &p.offsets, a);
        let _ = enginescope::sampler::probes::plan_exact(&p, a);
    }
});
