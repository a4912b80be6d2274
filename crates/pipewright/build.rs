//! With the `cuda` feature, compiles pipewright's CUDA kernels (every `src/kernels/cuda/*.cu`:
//! the folder is the one list of kernels) to PTX in OUT_DIR, and writes `modules.rs` there, a
//! `Module` constant per file (`flash.cu` -> `FLASH`), which `kernels::gpu` includes to embed the
//! PTX that candle's CUDA device loads at run time; and compiles each once more to machine code
//! only to check that no kernel spills registers to local memory (the build fails if one does:
//! a spill in these loops costs more than the kernel's arithmetic). nvcc is `$NVCC`, else
//! `nvcc` on the path (tools/build-cuda.sh sets it); the target is `sm_$CUDA_COMPUTE_CAP`
//! (default 90, the H100 and H200).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let dir = Path::new("src/kernels/cuda");
    // A kernel added or removed changes the folder.
    println!("cargo:rerun-if-changed={}", dir.display());
    for header in files_with(dir, "cuh") {
        println!(
            "cargo:rerun-if-changed={}",
            dir.join(format!("{header}.cuh")).display()
        );
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let arch = format!("-arch=sm_{cap}");
    let kernels = files_with(dir, "cu");
    write_modules(&out, &kernels);
    for name in &kernels {
        let src = dir.join(format!("{name}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        let ptx = out.join(format!("{name}.ptx"));
        let flags = ["-O3", "-std=c++17", "-lineinfo", arch.as_str()];
        run(Command::new(&nvcc)
            .args(flags)
            .arg("--ptx")
            .arg("-o")
            .arg(&ptx)
            .arg(&src));
        let check = run(Command::new(&nvcc)
            .args(flags)
            .args(["-cubin", "-Xptxas", "--warn-on-spills"])
            .arg("-o")
            .arg(out.join(format!("{name}.cubin")))
            .arg(&src));
        if check.contains("spill") {
            panic!(
                "{}: registers spill to local memory:\n{check}",
                src.display()
            );
        }
    }
}

/// The stem of every `.EXT` file in `dir`, sorted: with `cu`, the kernels; with `cuh`, the
/// headers they share.
fn files_with(dir: &Path, ext: &str) -> Vec<String> {
    let entries = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list the kernels in {}: {e}", dir.display()));
    let mut names: Vec<String> = entries
        .map(|e| e.expect("a readable folder entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .map(|p| {
            p.file_stem()
                .expect("a file with an extension has a stem")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

/// Writes `modules.rs` into `out`: one `Module` constant per kernel, named by its file in
/// capitals, embedding its PTX.
fn write_modules(out: &Path, kernels: &[String]) {
    let consts: String = kernels
        .iter()
        .map(|k| {
            format!(
                "/// `{k}.cu`'s kernels.\npub(crate) const {}: Module = Module {{ name: \"pipewright-{k}\", ptx: include_str!(concat!(env!(\"OUT_DIR\"), \"/{k}.ptx\")) }};\n",
                k.to_uppercase()
            )
        })
        .collect();
    std::fs::write(out.join("modules.rs"), consts).expect("OUT_DIR is writable");
}

/// Runs `cmd`, failing the build with its output if it fails; returns its stderr.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?} ({e}): the cuda feature needs nvcc (tools/build-cuda.sh installs it)"));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        panic!("{cmd:?} failed:\n{err}");
    }
    err
}
