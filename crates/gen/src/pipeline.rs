//! The generator run by build.rs: each stage a small function returning
//! Result. Log lines come back to the caller (build.rs prints them; see
//! buildlog.rs for what they say).

use super::buildlog::{self, Origin};
use super::check::{accepts, parse_report, ReportError, Resources};
use super::compile::{compile, CompileError, Toolchain, INSTALL_HINT};
use super::embed::{self, Built, Manifest, NoInstance};
use super::expand::{expand, Expansion};
use super::render::{RenderError, Renderer, STATIC_HEADERS};
use super::snapshot;
use super::spec::{self, SpecError, Specs};
use crate::kinds::Arch;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Render(#[from] RenderError),
    #[error(transparent)]
    Compile(#[from] CompileError),
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error(transparent)]
    NoInstance(#[from] NoInstance),
    #[error("{0}")]
    Snapshot(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PipelineError + '_ {
    move |source| PipelineError::Io { path: path.to_path_buf(), source }
}

pub struct Options {
    pub crate_dir: PathBuf,
    pub out_dir: PathBuf,
    pub cache_dir: PathBuf,
    /// MIXSTACK_ONLY: narrow the instance set (development builds).
    pub only: Option<String>,
    /// MIXSTACK_BLESS: write generated-tests/ from this build.
    pub bless: bool,
}

pub struct Outcome {
    pub log: Vec<String>,
    /// "toolchain" or "snapshot".
    pub source: &'static str,
    pub manifest: Manifest,
}

/// Rendered files: (file name, text) for ops.cuh and every instance .cu.
pub fn render_all(specs: &Specs, exp: &Expansion, templates: &Path) -> Result<Vec<(String, String)>, PipelineError> {
    let r = Renderer::new(templates)?;
    let mut files = vec![("ops.cuh".to_string(), r.ops_header(specs)?)];
    for i in &exp.instances {
        files.push((format!("{}.cu", i.name), r.instance(i)?));
    }
    Ok(files)
}

pub fn run(opts: &Options) -> Result<Outcome, PipelineError> {
    let mut log = Vec::new();
    let specs = spec::load(&opts.crate_dir.join("specs"))?;
    let exp = expand(&specs, opts.only.as_deref())?;
    if opts.only.is_none() {
        check_defaults(&specs, &exp)?;
    }

    // render
    let cuda = opts.out_dir.join("cuda");
    std::fs::create_dir_all(&cuda).map_err(io(&cuda))?;
    let templates = opts.crate_dir.join("templates");
    let rendered = render_all(&specs, &exp, &templates)?;
    for h in STATIC_HEADERS {
        let (from, to) = (templates.join(h), cuda.join(h));
        std::fs::copy(&from, &to).map_err(io(&from))?;
    }
    for (name, text) in &rendered {
        let p = cuda.join(name);
        write_if_changed(&p, text)?;
    }

    // compile + check, or the snapshot
    let fingerprint = snapshot::fingerprint(&opts.crate_dir).map_err(io(&opts.crate_dir))?;
    let committed = buildlog::committed(&opts.crate_dir);
    let archs = specs.stages.archs.clone();
    let (mut built, origin) = match Toolchain::find(&opts.crate_dir).map_err(PipelineError::Snapshot)? {
        Ok(tc) => {
            let (built, cached) = compile_all(&tc, &exp, &cuda, &rendered, &opts.cache_dir)?;
            let compiled = built.len() - cached;
            (built, Origin::Toolchain { version: tc.version, compiled, cached })
        }
        Err(missing) => (
            from_snapshot(opts, &exp, &fingerprint, &missing)?,
            Origin::Snapshot { fingerprint: fingerprint.clone(), missing },
        ),
    };
    let source = origin.source();

    let lmax = (specs.stages.lmax.min, specs.stages.lmax.max);
    let dispatch = embed::resolve_dispatch(&mut built, &archs, lmax)?;
    let rows = dispatch.iter().map(|(r, _)| r.clone()).collect();
    let manifest = embed::manifest(&archs, lmax, &fingerprint, &built, rows, &exp.pruned);
    let manifest_path = opts.out_dir.join("build_manifest.json");
    let json = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
    std::fs::write(&manifest_path, &json).map_err(io(&manifest_path))?;
    let table = opts.out_dir.join("kernel_table.rs");
    std::fs::write(&table, embed::kernel_table(&built, &archs, lmax, source, &manifest_path)).map_err(io(&table))?;
    let args = opts.out_dir.join("stage_args.rs");
    std::fs::write(&args, crate::args::stage_args(&specs)).map_err(io(&args))?;
    let roles = opts.out_dir.join("stage_roles.rs");
    std::fs::write(&roles, embed::stage_roles(&specs)).map_err(io(&roles))?;

    if opts.bless {
        bless(opts, &rendered, &built, &json, &fingerprint)?;
        log.push(format!("blessed {}/ (fingerprint {})", snapshot::DIR, &fingerprint[..12]));
    }
    log.extend(buildlog::lines(&manifest, committed.as_ref(), &origin, opts.bless));
    Ok(Outcome { log, source, manifest })
}

/// Every `defaults` entry of tiles.yaml must name an instance the expansion
/// produced (a pruned one is reported by its own build line).
pub fn check_defaults(specs: &Specs, exp: &Expansion) -> Result<(), SpecError> {
    for (i, d) in specs.tiles.defaults.iter().enumerate() {
        let name = crate::kinds::name_with_tag(d.stage, d.dtype, d.cf, &d.tile);
        let known = exp.instances.iter().any(|x| x.name == name) || exp.pruned.iter().any(|p| p.name == name);
        if !known {
            return Err(specs.invalid(
                "tiles.yaml",
                format!("defaults[{i}]"),
                format!("no instance {name}: the tile is not in the stage's tile set for that dtype and Cf"),
            ));
        }
        if let Some(x) = exp.instances.iter().find(|x| x.name == name) {
            let p = x.geometry.precision();
            if p != d.precision {
                return Err(specs.invalid(
                    "tiles.yaml",
                    format!("defaults[{i}].precision"),
                    format!("{name} is an {p} tile; its default must say `precision: {p}` (here: {})", d.precision),
                ));
            }
        }
    }
    Ok(())
}

fn write_if_changed(p: &Path, text: &str) -> Result<(), PipelineError> {
    if std::fs::read_to_string(p).ok().as_deref() != Some(text) {
        std::fs::write(p, text).map_err(io(p))?;
    }
    Ok(())
}

/// Every instance once per arch it targets; `Built` rows instance-major.
fn compile_all(
    tc: &Toolchain,
    exp: &Expansion,
    cuda: &Path,
    rendered: &[(String, String)],
    cache: &Path,
) -> Result<(Vec<Built>, usize), PipelineError> {
    std::fs::create_dir_all(cache).map_err(io(cache))?;
    // Shared headers are part of every instance's cache key.
    let mut common = rendered[0].1.clone().into_bytes();
    for h in STATIC_HEADERS {
        let p = cuda.join(h);
        common.extend(std::fs::read(&p).map_err(io(&p))?);
    }
    let jobs: Vec<(usize, Arch)> =
        exp.instances.iter().enumerate().flat_map(|(i, inst)| inst.archs.iter().map(move |&a| (i, a))).collect();
    let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Result<(usize, super::compile::Compiled), CompileError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(i, arch)) = jobs.get(k) else { break };
                        let name = &exp.instances[i].name;
                        let src = cuda.join(format!("{name}.cu"));
                        let mut key = common.clone();
                        key.extend(rendered[i + 1].1.as_bytes());
                        let target = arch.target(exp.instances[i].geometry.arch_specific());
                        out.push(compile(tc, target, name, &src, cuda, &key, cache).map(|c| (k, c)));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("compile worker panicked")).collect()
    });
    let mut compiled: Vec<Option<super::compile::Compiled>> = vec![None; jobs.len()];
    for r in results {
        let (k, c) = r?;
        compiled[k] = Some(c);
    }
    let mut cached = 0;
    let mut built = Vec::new();
    for (&(i, arch), c) in jobs.iter().zip(compiled) {
        let (inst, c) = (&exp.instances[i], c.expect("every job ran"));
        cached += c.cached as usize;
        let resources = parse_report(&c.report, &inst.name)?;
        let accepted = accepts(&inst.geometry, &resources);
        built.push(Built {
            instance: inst.clone(),
            arch,
            accepted,
            resources,
            is_default: false,
            ptx: Some(c.ptx),
            cubin: Some(c.cubin),
        });
    }
    Ok((built, cached))
}

fn from_snapshot(
    opts: &Options,
    exp: &Expansion,
    fingerprint: &str,
    missing: &str,
) -> Result<Vec<Built>, PipelineError> {
    let dir = opts.crate_dir.join(snapshot::DIR);
    let committed = snapshot::committed_fingerprint(&opts.crate_dir);
    if committed.as_deref() != Some(fingerprint) {
        return Err(PipelineError::Snapshot(format!(
            "no CUDA 13.0 toolchain found ({missing}), and the snapshot in {} does not match this tree (fingerprint {} vs committed {}): {INSTALL_HINT}, then `cargo build` again",
            dir.display(),
            &fingerprint[..12],
            committed.as_deref().map(|c| &c[..12]).unwrap_or("none or unreadable")
        )));
    }
    let mpath = dir.join(snapshot::MANIFEST_FILE);
    let text = std::fs::read_to_string(&mpath).map_err(io(&mpath))?;
    let m: Manifest =
        serde_json::from_str(&text).map_err(|e| PipelineError::Snapshot(format!("{}: {e}", mpath.display())))?;
    let mut built = Vec::new();
    for (inst, &arch) in exp.instances.iter().flat_map(|i| i.archs.iter().map(move |a| (i, a))) {
        let row = m.instances.iter().find(|r| r.name == inst.name && r.arch == arch).ok_or_else(|| {
            PipelineError::Snapshot(format!(
                "{} has no row for {} on {arch}; re-bless with the toolchain",
                mpath.display(),
                inst.name
            ))
        })?;
        let resources = Resources {
            registers: row.registers,
            spill_stores: row.spill_stores,
            spill_loads: row.spill_loads,
            stack_bytes: row.stack_bytes,
            smem_static: row.smem_static,
        };
        let ptx = snapshot::ptx_path(&dir, arch, &inst.name);
        let accepted = accepts(&inst.geometry, &resources);
        if accepted && !ptx.exists() {
            return Err(PipelineError::Snapshot(format!("{} is missing; re-bless with the toolchain", ptx.display())));
        }
        built.push(Built {
            instance: inst.clone(),
            arch,
            resources,
            accepted,
            is_default: false,
            ptx: accepted.then_some(ptx),
            cubin: None,
        });
    }
    Ok(built)
}

fn bless(
    opts: &Options,
    rendered: &[(String, String)],
    built: &[Built],
    manifest_json: &str,
    fingerprint: &str,
) -> Result<(), PipelineError> {
    if opts.only.is_some() {
        return Err(PipelineError::Snapshot("refusing to bless a narrowed build (MIXSTACK_ONLY is set)".into()));
    }
    let dir = opts.crate_dir.join(snapshot::DIR);
    let cuda = dir.join(snapshot::CUDA_DIR);
    let ptx = dir.join(snapshot::PTX_DIR);
    for d in [&cuda, &ptx] {
        if d.exists() {
            std::fs::remove_dir_all(d).map_err(io(d))?;
        }
        std::fs::create_dir_all(d).map_err(io(d))?;
    }
    for (name, text) in rendered {
        let p = cuda.join(name);
        std::fs::write(&p, text).map_err(io(&p))?;
    }
    for b in built.iter().filter(|b| b.accepted) {
        if let Some(src) = &b.ptx {
            let p = snapshot::ptx_path(&dir, b.arch, &b.instance.name);
            if let Some(d) = p.parent().filter(|d| !d.exists()) {
                std::fs::create_dir_all(d).map_err(io(d))?;
            }
            std::fs::copy(src, &p).map_err(io(src))?;
        }
    }
    let m = dir.join(snapshot::MANIFEST_FILE);
    std::fs::write(&m, format!("{manifest_json}\n")).map_err(io(&m))?;
    let f = dir.join(snapshot::FINGERPRINT_FILE);
    std::fs::write(&f, format!("{fingerprint}\n")).map_err(io(&f))?;
    Ok(())
}
