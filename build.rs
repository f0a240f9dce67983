//! Builds ebpf/*.bpf.c with clang when it is installed; otherwise uses the committed objects,
//! so `cargo build` works without clang. Either way the object lands in OUT_DIR.
//! CI rebuilds with ebpf/build.sh and fails if the result differs from the committed objects.

use std::path::PathBuf;
use std::process::Command;

// A build script that cannot read cargo's own variables or find the committed object has
// nothing to fall back on: it stops the build with the reason.
#[allow(clippy::expect_used)]
fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let ebpf = manifest.join("ebpf");
    for f in ["sampler.bpf.c", "sampler.h", "build.sh", "sampler.bpf.o"] {
        println!("cargo:rerun-if-changed=ebpf/{f}");
    }
    println!("cargo:rerun-if-env-changed=ENGINESCOPE_NO_CLANG");
    let have_clang = std::env::var_os("ENGINESCOPE_NO_CLANG").is_none()
        && Command::new("clang")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        && Command::new("llvm-strip")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    let committed = ebpf.join("sampler.bpf.o");
    let target = out.join("sampler.bpf.o");
    if have_clang {
        let st = Command::new("bash")
            .arg(ebpf.join("build.sh"))
            .arg(&out)
            .status();
        match st {
            Ok(s) if s.success() => {
                if std::fs::read(&target).ok() != std::fs::read(&committed).ok() {
                    println!("cargo:warning=ebpf/sampler.bpf.o is stale: rebuild with `bash ebpf/build.sh` and commit it");
                }
                return;
            }
            _ => println!("cargo:warning=building the BPF object with clang failed; using the committed ebpf/sampler.bpf.o"),
        }
    }
    std::fs::copy(&committed, &target).expect("ebpf/sampler.bpf.o (committed BPF object) missing");
}
