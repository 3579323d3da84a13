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
}

fn init_logging(cfg: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cfg.log.level));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match cfg.log.format {
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
            let mut cfg = match config.as_deref().map(Config::load).transpose() {
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
            init_logging(&cfg);
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
