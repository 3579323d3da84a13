//! The `moongate` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use moongate::config::{Config, LogFormat};

/// moongate: a policy sidecar for the Mooncake KV-cache store.
///
/// Point a Mooncake client's `master_server_address` at moongate's master face; moongate
/// forwards every call to the real master and decodes the ones policies act on.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the master face and the admin endpoint until SIGTERM/SIGINT.
    Run {
        /// TOML config file (see config/reference.toml); flags below override it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Master face address clients connect to (master_face.listen).
        #[arg(long, value_name = "HOST:PORT")]
        listen: Option<String>,
        /// The real mooncake_master RPC address (master_face.upstream).
        #[arg(long, value_name = "HOST:PORT")]
        upstream: Option<String>,
        /// Admin endpoint address (admin.listen).
        #[arg(long, value_name = "HOST:PORT")]
        admin: Option<String>,
        /// Serve the kv HTTP API here (kv.listen).
        #[arg(long, value_name = "HOST:PORT")]
        kv: Option<String>,
        /// The metadata server URL Mooncake clients use (kv.metadata_url).
        #[arg(long, value_name = "URL")]
        metadata: Option<String>,
    },
    /// Validate a config file and report every problem found.
    CheckConfig {
        /// The TOML file to check.
        file: PathBuf,
    },
    /// Evaluate policies offline over a request trace: prefix hit rates of each plugin
    /// next to native LRU and Belady's optimum, at each capacity (docs/policy-science.md).
    Sim(SimArgs),
    /// Look at a fleet of moongates (`[fleet]`) from etcd.
    Fleet {
        #[command(subcommand)]
        action: FleetCommand,
    },
    /// Move plugin components to and from OCI registries (the CNCF Wasm artifact
    /// layout), with their minisign signatures.
    Plugin {
        #[command(subcommand)]
        action: PluginCommand,
    },
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Push a component; its signature (`--signature`, or `FILE.minisig` when present)
    /// goes along as a manifest annotation. Prints the pinned reference
    /// (`oci://HOST/REPO@sha256:...`).
    Push {
        /// The component (`.wasm`).
        file: PathBuf,
        /// `oci://HOST[:PORT]/REPOSITORY[:TAG]`.
        reference: String,
        /// A minisign signature of FILE (default: FILE.minisig, when present).
        #[arg(long)]
        signature: Option<PathBuf>,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Pull a component into `--out` and its signature, if any, into `OUT.minisig`.
    /// Prints the pinned reference.
    Pull {
        /// `oci://HOST[:PORT]/REPOSITORY(:TAG|@sha256:DIGEST)`.
        reference: String,
        /// Where to write the component.
        #[arg(long, short)]
        out: PathBuf,
        #[command(flatten)]
        registry: RegistryArgs,
    },
}

#[derive(Subcommand)]
enum FleetCommand {
    /// The members of a cluster, each arm's lookups and hits added up across them, and
    /// each arm's hit rate against the control's with a 95 % interval (two-proportion
    /// normal approximation), read once from etcd.
    Status {
        /// etcd endpoints, `HOST:PORT[;HOST:PORT...]`.
        #[arg(long)]
        etcd: String,
        /// The fleet's cluster (`fleet.cluster`).
        #[arg(long, default_value = "default")]
        cluster: String,
        /// The control arm (default: the one the members name).
        #[arg(long)]
        control: Option<String>,
        /// Print the JSON `GET /fleet` gives instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn fleet(action: FleetCommand) -> Result<String, String> {
    let FleetCommand::Status {
        etcd,
        cluster,
        control,
        json,
    } = action;
    let endpoints = moongate::fleet::config::parse_endpoints(&etcd);
    if endpoints.is_empty() {
        return Err("--etcd: no endpoint".into());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let view = rt
        .block_on(moongate::fleet::membership::read(&endpoints, &cluster))
        .map_err(|e| format!("etcd {etcd}: {e}"))?;
    let mut r = moongate::fleet::report(&view, control.as_deref());
    r["cluster"] = cluster.clone().into();
    if json {
        return Ok(r.to_string());
    }
    let mut out = format!("cluster {cluster}: {} members\n", view.members.len());
    out +=
        "member                           keys        bytes  evicted_bytes  rounds_called  admin\n";
    for m in view.members.values() {
        out += &format!(
            "{:<28} {:>8} {:>12} {:>14}  {:>13}  {}\n",
            m.member, m.keys, m.bytes, m.evicted_bytes, m.rounds_called, m.admin
        );
    }
    out += "arm                  hits     misses  hit_rate  vs control (95 %)\n";
    for a in r["arms"].as_array().into_iter().flatten() {
        let rate = a["hit_rate"]
            .as_f64()
            .map_or("-".to_string(), |v| format!("{v:.4}"));
        let vs = match a["vs_control"].as_object() {
            Some(d) => format!(
                "{:+.4} [{:+.4}, {:+.4}] {}",
                d["diff"].as_f64().unwrap_or(0.0),
                d["low"].as_f64().unwrap_or(0.0),
                d["high"].as_f64().unwrap_or(0.0),
                if d["significant"].as_bool() == Some(true) {
                    "significant"
                } else {
                    "not yet significant"
                }
            ),
            None if Some(a["name"].as_str().unwrap_or("")) == r["control"].as_str() => {
                "(control)".into()
            }
            None => "-".into(),
        };
        out += &format!(
            "{:<16} {:>8} {:>10}  {:>8}  {}\n",
            a["name"].as_str().unwrap_or(""),
            a["hits"],
            a["misses"],
            rate,
            vs
        );
    }
    Ok(out.trim_end().to_string())
}

/// How to reach a registry (the `policy.*` keys of the same names, for the CLI).
#[derive(clap::Args)]
struct RegistryArgs {
    /// A registry (`HOST[:PORT]`) that may be reached over plain HTTP when HTTPS fails;
    /// repeat for several. Loopback registries always may.
    #[arg(long = "insecure-registry", value_name = "HOST[:PORT]")]
    insecure: Vec<String>,
    /// Docker-style credentials file (default: $DOCKER_CONFIG/config.json, else
    /// ~/.docker/config.json, when present).
    #[arg(long)]
    auth_file: Option<String>,
    /// Largest component to pull, in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_bytes: u64,
    /// Deadline of the whole push or pull, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    timeout_ms: u64,
}

impl RegistryArgs {
    fn settings(&self) -> moongate::supply::oci::Settings {
        moongate::supply::oci::Settings {
            insecure: self.insecure.clone(),
            auth_file: moongate::supply::credentials::auth_file(
                self.auth_file.as_deref().unwrap_or(""),
            ),
            max_bytes: self.max_bytes,
            timeout: std::time::Duration::from_millis(self.timeout_ms),
        }
    }
}

fn plugin(action: PluginCommand) -> Result<String, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    match action {
        PluginCommand::Push {
            file,
            reference,
            signature,
            registry,
        } => {
            let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let sig_path = signature.unwrap_or_else(|| {
                let mut p = file.clone().into_os_string();
                p.push(".minisig");
                PathBuf::from(p)
            });
            let sig = std::fs::read_to_string(&sig_path).ok();
            rt.block_on(moongate::supply::oci::push(
                bytes,
                sig.as_deref(),
                &reference,
                &registry.settings(),
            ))
            .map_err(|e| e.to_string())
        }
        PluginCommand::Pull {
            reference,
            out,
            registry,
        } => {
            let p = rt
                .block_on(moongate::supply::oci::pull(
                    &reference,
                    &registry.settings(),
                ))
                .map_err(|e| e.to_string())?;
            std::fs::write(&out, &p.bytes).map_err(|e| format!("{}: {e}", out.display()))?;
            if let Some(sig) = &p.signature {
                let mut path = out.clone().into_os_string();
                path.push(".minisig");
                std::fs::write(&path, sig).map_err(|e| format!("{path:?}: {e}"))?;
            }
            Ok(p.pinned)
        }
    }
}

/// `moongate sim`'s arguments.
#[derive(clap::Args)]
struct SimArgs {
    /// A Mooncake trace, JSONL with `timestamp` and `hash_ids` per request.
    #[arg(long)]
    trace: PathBuf,
    /// Comma list of shares of the trace's distinct blocks (`5%,10%`) or sizes
    /// (`64MiB`).
    #[arg(long, value_name = "SPEC")]
    capacity: String,
    /// Bytes per block.
    #[arg(long, default_value_t = 65536)]
    block_size: u64,
    /// A plugin: a name built into target/plugins/ (`lru`, `prefix-evict`, ...),
    /// `default`, or a path to a .wasm component, optionally with the config its
    /// `configure` gets: `NAME='{"json": ...}'` inline, or `NAME=@config.json` from a
    /// file (as `[[policy.plugins]] config` live). Repeat for several.
    #[arg(long = "policy", value_name = "NAME_OR_WASM[=CONFIG]")]
    policies: Vec<String>,
    /// `on-demand` (a put that does not fit frees exactly what it needs) or `live`
    /// (moongate's watermark rounds, the master's own eviction, read leases).
    #[arg(long, value_enum, default_value_t = RulesArg::OnDemand)]
    rules: RulesArg,
    /// On-demand rules: a round asks the plugin for victims worth at least this share
    /// of the capacity (they leave only as room is needed). 0.1: the size of a live
    /// round between the default watermarks (0.8 -> 0.7).
    #[arg(long, default_value_t = 0.1)]
    evict_batch: f64,
    /// Least recently used keys offered to the plugin per round
    /// (eviction.max_candidates).
    #[arg(long, default_value_t = 4096)]
    max_candidates: usize,
    /// Live rules: trace time is divided by this (the replay's --speed).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Live rules: moongate's eviction.high_watermark / low_watermark.
    #[arg(long, default_value_t = 0.8)]
    high: f64,
    #[arg(long, default_value_t = 0.7)]
    low: f64,
    /// Live rules: the master's read lease (--default_kv_lease_ttl), ms, in wall time;
    /// 0 = none. The default is 0.3.13's and 0.3.14's (0.3.11's was 5000).
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// Also model a fleet of this many sidecars on one pool (each evicting its own
    /// blocks within an equal quota, seeing only the accesses routed to it; and with
    /// the fleet's access records): adds `POLICY xN ROUTE` and `POLICY xN ROUTE records`
    /// rows next to each single-evictor row, for `lru` and every plugin (one instance
    /// per sidecar; at most 64 sidecars with plugins).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// How the fleet's requests reach ranks: `random`, or `sticky` (by the first block).
    #[arg(long, value_enum, default_value_t = RouteArg::Random)]
    route: RouteArg,
    /// Hint streams derived from the trace, given to every plugin (`lru` and `opt` stay
    /// hint-free): a comma list of `queue:W` (a router announces the next W requests'
    /// blocks as upcoming), `last:P[@D]` (for a share P of the requests, the blocks the
    /// trace never reads again are announced done D ms after it), `expect:P[@W]` (for a
    /// share P of the requests, the blocks read again within W ms, default 60000, are
    /// announced expected within W), `wrong:F` (a share F of the done hints are wrong),
    /// `ttl:MS` (a cap on how long done hints are kept; default none: in force until
    /// their block is read or stored again), `seed:N`.
    /// See docs/policy-science.md.
    #[arg(long, value_name = "SPEC")]
    hints: Option<String>,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw the miss-ratio curves here (SVG).
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RouteArg {
    Random,
    Sticky,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RulesArg {
    OnDemand,
    Live,
}

/// A `--policy` argument (`NAME_OR_WASM[=CONFIG]`) as bytes, config and a report label.
fn plugin_source(arg: &str) -> Result<moongate::sim::PluginSource, String> {
    // A path that exists is taken whole, even with a `=` in it.
    let (arg, config) = match arg.split_once('=') {
        Some((name, config)) if !std::path::Path::new(arg).is_file() => {
            let config = match config.strip_prefix('@') {
                Some(file) => std::fs::read(file)
                    .map_err(|e| format!("--policy {name}: config file {file}: {e}"))?,
                None => config.as_bytes().to_vec(),
            };
            if let Err(e) = serde_json::from_slice::<serde_json::Value>(&config) {
                return Err(format!("--policy {name}: its config is not JSON: {e}"));
            }
            (name, config)
        }
        _ => (arg, Vec::new()),
    };
    let path = std::path::Path::new(arg);
    let (label, bytes) = if path.is_file() {
        let stem = path
            .file_stem()
            .map_or(arg.into(), |s| s.to_string_lossy().into_owned());
        let bytes = std::fs::read(path).map_err(|e| format!("{arg}: {e}"))?;
        (format!("{stem}.wasm"), bytes)
    } else if arg == "default" {
        (
            "default.wasm".to_string(),
            moongate::policy::registry::DEFAULT_PLUGIN.to_vec(),
        )
    } else {
        let local = std::path::Path::new("target/plugins").join(format!("{arg}.wasm"));
        let built = moongate::policy::registry::built_plugin(arg);
        let found = [local, built].into_iter().find(|p| p.is_file()).ok_or_else(|| {
            format!("{arg}: no such file, and no target/plugins/{arg}.wasm (build the plugins with cargo build)")
        })?;
        let bytes = std::fs::read(&found).map_err(|e| format!("{}: {e}", found.display()))?;
        (format!("{arg}.wasm"), bytes)
    };
    Ok(moongate::sim::PluginSource {
        label,
        bytes,
        config,
    })
}

fn sim(a: SimArgs) -> Result<(), String> {
    let SimArgs {
        trace,
        capacity,
        block_size,
        policies,
        rules,
        evict_batch,
        max_candidates,
        speed,
        high,
        low,
        lease_ms,
        ranks,
        route,
        json,
        plot,
        hints,
    } = a;
    if ranks == 0 || ranks > 4096 {
        return Err("--ranks must be in 1..=4096".into());
    }
    // A plugin's own log lines (`host::log`) are what its author debugs it by: shown
    // on stderr, warnings and errors by default, more with RUST_LOG (`info`,
    // `debug`). The table stays on stdout.
    init_logging("warn", LogFormat::Text);
    let live = moongate::sim::Live {
        speed,
        high,
        low,
        lease_ms,
        ..Default::default()
    };
    use moongate::sim;
    let capacities = sim::Capacity::parse_list(&capacity).map_err(|e| format!("--capacity {e}"))?;
    if block_size == 0 {
        return Err("--block-size must be positive".into());
    }
    if live.speed.is_nan() || live.speed <= 0.0 {
        return Err("--speed must be positive".into());
    }
    if !(0.0..0.5).contains(&evict_batch) {
        return Err("--evict-batch must be in [0, 0.5)".into());
    }
    let text = std::fs::read_to_string(&trace).map_err(|e| format!("{}: {e}", trace.display()))?;
    let t = sim::Trace::parse(&text).map_err(|e| format!("{}: {e}", trace.display()))?;
    let plugins = policies
        .iter()
        .map(|p| plugin_source(p))
        .collect::<Result<Vec<_>, _>>()?;
    let spec = sim::Spec {
        trace_name: trace.file_name().map_or_else(
            || trace.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        ),
        capacities,
        block_size,
        plugins,
        rules: match rules {
            RulesArg::OnDemand => sim::Rules::OnDemand { batch: evict_batch },
            RulesArg::Live => {
                if !(0.0 < live.low && live.low < live.high && live.high <= 1.0) {
                    return Err("need 0 < --low < --high <= 1".into());
                }
                sim::Rules::Live(live)
            }
        },
        max_candidates: max_candidates.max(1),
        ranks,
        route: match route {
            RouteArg::Random => sim::baseline::Route::Random,
            RouteArg::Sticky => sim::baseline::Route::Sticky,
        },
        hints: hints
            .as_deref()
            .map(sim::hints::HintSpec::parse)
            .transpose()
            .map_err(|e| format!("--hints {e}"))?,
    };
    let report = sim::run(&t, &spec).map_err(|e| e.to_string())?;
    print!("{}", sim::report::table(&report));
    if let Some(p) = json {
        let body = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(&p, body).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if let Some(p) = plot {
        sim::report::plot_svg(&report, &p)?;
    }
    Ok(())
}

/// Logs to stderr at RUST_LOG, else at `level`.
fn init_logging(level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

/// One worker: the thread sleeps in epoll itself, so a frame is relayed without a
/// cross-thread wake-up (the master face's latency floor). More workers: a
/// multi-threaded runtime for nodes with many busy ranks.
fn build_runtime(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    if workers <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Sim(args) => match sim(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("moongate sim: {e}");
                ExitCode::from(2)
            }
        },
        Command::Fleet { action } => match fleet(action) {
            Ok(text) => {
                println!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("moongate fleet: {e}");
                ExitCode::from(2)
            }
        },
        Command::Plugin { action } => match plugin(action) {
            Ok(pinned) => {
                println!("{pinned}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("moongate plugin: {e}");
                ExitCode::from(2)
            }
        },
        Command::CheckConfig { file } => match Config::load(&file) {
            Ok(_) => {
                println!("{}: ok", file.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: invalid\n{e}", file.display());
                ExitCode::from(2)
            }
        },
        Command::Run {
            config,
            listen,
            upstream,
            admin,
            kv,
            metadata,
        } => {
            // Validated once, after the flags: they override the file.
            let mut cfg = match config.as_deref().map(Config::read).transpose() {
                Ok(c) => c.unwrap_or_default(),
                Err(e) => {
                    eprintln!("moongate: {e}");
                    return ExitCode::from(2);
                }
            };
            if let Some(v) = listen {
                cfg.master_face.listen = v;
            }
            if let Some(v) = upstream {
                cfg.master_face.upstream = v;
            }
            if let Some(v) = admin {
                cfg.admin.listen = v;
            }
            if let Some(v) = kv {
                cfg.kv.listen = v;
            }
            if let Some(v) = metadata {
                cfg.kv.metadata_url = v;
            }
            if let Err(e) = cfg.validate() {
                eprintln!("moongate: invalid configuration\n{e}");
                return ExitCode::from(2);
            }
            init_logging(&cfg.log.level, cfg.log.format);
            let rt = match build_runtime(cfg.runtime.worker_threads) {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("moongate: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(moongate::server::run(cfg)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %e, "moongate stopped");
                    eprintln!("moongate: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
