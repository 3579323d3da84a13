//! HA masters through etcd: a real etcd (Debian's etcd-server) and two
//! `mooncake_master --enable_ha` on loopback ports; moongate's upstream is
//! `etcd://HOST:PORT`, as a Mooncake client's would be. The segment descriptors live in
//! a separate metadata server (an HA master's embedded one dies with it).

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::*;

struct Etcd {
    proc: Proc,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl Etcd {
    fn start() -> Etcd {
        let dir = tempdir();
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("127.0.0.1:{client}");
        let mut cmd = Command::new("etcd");
        cmd.args([
            "--name",
            "t",
            "--data-dir",
            dir.path().join("data").to_str().unwrap(),
            "--listen-client-urls",
            &format!("http://{endpoint}"),
            "--advertise-client-urls",
            &format!("http://{endpoint}"),
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-cluster",
            &format!("t=http://127.0.0.1:{peer}"),
        ]);
        let proc = Proc::spawn("etcd", cmd, dir.path().join("etcd.log"));
        wait_for("etcd healthy", Duration::from_secs(30), &[&proc], || {
            http_get(&endpoint, "/health").is_some_and(|(s, b)| s == 200 && b.contains("true"))
        });
        Etcd {
            proc,
            endpoint,
            _dir: dir,
        }
    }
}

struct HaMaster {
    proc: Proc,
    rpc: String,
    admin: String,
    _dir: tempfile::TempDir,
}

impl HaMaster {
    fn start(etcd: &Etcd) -> HaMaster {
        let dir = tempdir();
        let (rpc, admin) = (free_port(), free_port());
        let mut cmd = Command::new(master_binary());
        cmd.args([
            "--enable_ha=true".to_string(),
            format!("--etcd_endpoints={}", etcd.endpoint),
            format!("--rpc_port={rpc}"),
            "--rpc_address=127.0.0.1".into(),
            format!("--metrics_port={admin}"),
            "--metrics_host=127.0.0.1".into(),
            "--enable_metric_reporting=false".into(),
        ])
        .current_dir(dir.path());
        let proc = Proc::spawn("ha master", cmd, dir.path().join("master.log"));
        let m = HaMaster {
            proc,
            rpc: format!("127.0.0.1:{rpc}"),
            admin: format!("127.0.0.1:{admin}"),
            _dir: dir,
        };
        wait_for(
            "HA master admin",
            Duration::from_secs(30),
            &[&m.proc],
            || http_get(&m.admin, "/health").is_some(),
        );
        m
    }

    /// `/health`'s `ha_state` (`serving` for the leader that answers).
    fn state(&self) -> String {
        http_get(&self.admin, "/health")
            .and_then(|(_, b)| serde_json::from_str::<Value>(&b).ok())
            .and_then(|v| v["ha_state"].as_str().map(String::from))
            .unwrap_or_default()
    }
}

/// Mooncake's standalone metadata server (`python -m mooncake.http_metadata_server`).
fn metadata_server() -> (Proc, String, tempfile::TempDir) {
    let port = free_port();
    let dir = tempdir();
    let mut cmd = Command::new(python());
    cmd.args([
        "-m",
        "mooncake.http_metadata_server",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
    ]);
    let proc = Proc::spawn("metadata server", cmd, dir.path().join("metadata.log"));
    let addr = format!("127.0.0.1:{port}");
    wait_for("metadata server", Duration::from_secs(30), &[&proc], || {
        http_get(&addr, "/metadata?key=probe").is_some()
    });
    (proc, format!("http://{addr}/metadata"), dir)
}

/// Two real clients put and read back through moongate while the leader is SIGKILLed:
/// their calls fail fast, then succeed against the new leader (after its remount); no
/// read is ever wrong; moongate follows the leader (metrics, `/ready`) and leaks no
/// connection.
#[test]
fn moongate_follows_the_leader_through_a_failover_under_load() {
    failover(libc::SIGKILL, 1.0);
}

/// The leader freezes (SIGSTOP: its port still accepts, nothing answers): calls in
/// flight to it hang until its lease expires and the standby takes over, then moongate
/// closes those connections (no call waits on the frozen master for ever) and the
/// clients carry on against the new leader.
#[test]
fn a_frozen_leader_is_left_when_the_standby_takes_over() {
    failover(libc::SIGSTOP, 15.0);
}

/// `signal` takes the leader out; failed client rounds must return within
/// `slowest_failure_s`.
fn failover(signal: i32, slowest_failure_s: f64) {
    let etcd = Etcd::start();
    let (md_proc, metadata, _md_dir) = metadata_server();
    let a = HaMaster::start(&etcd);
    let b = HaMaster::start(&etcd);
    let serving = |m: &HaMaster| m.state() == "serving";
    wait_for(
        "a leader serves",
        Duration::from_secs(30),
        &[&a.proc, &b.proc],
        || serving(&a) || serving(&b),
    );
    let (old, new) = if serving(&a) { (&a, &b) } else { (&b, &a) };
    let (old_rpc, new_rpc) = (old.rpc.clone(), new.rpc.clone());
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"etcd://{}\"\n",
        etcd.endpoint
    ));
    let logs = [&etcd.proc, &a.proc, &b.proc, &mg.proc, &md_proc];
    wait_for("moongate ready", Duration::from_secs(20), &logs, || {
        http_get(&mg.admin, "/ready").is_some_and(|(s, _)| s == 200)
    });
    assert_eq!(
        mg.metric(&format!(
            "moongate_upstream_leader{{address=\"{old_rpc}\"}}"
        )),
        1.0
    );
    let c1 = Background::start("failover", &mg.listen, &metadata, &logs);
    let c2 = Background::start("failover", &mg.listen, &metadata, &logs);
    // Let both serve a while against the first leader.
    let first_ok = Instant::now();
    wait_for(
        "calls through the first leader",
        Duration::from_secs(20),
        &logs,
        || mg.metric("moongate_master_requests_total{method=\"UpsertStart\"}") >= 20.0,
    );
    let killed = Instant::now();
    old.proc.signal(signal);
    wait_for("the standby serves", Duration::from_secs(40), &logs, || {
        new.state() == "serving"
    });
    let new_serving = killed.elapsed();
    wait_for("moongate follows", Duration::from_secs(20), &logs, || {
        mg.metric(&format!(
            "moongate_upstream_leader{{address=\"{new_rpc}\"}}"
        )) == 1.0
            && http_get(&mg.admin, "/ready").is_some_and(|(s, _)| s == 200)
    });
    // Both clients succeed again against the new leader.
    let before = mg.metric("moongate_master_requests_total{method=\"UpsertStart\"}");
    wait_for(
        "calls through the new leader",
        Duration::from_secs(40),
        &logs,
        || mg.metric("moongate_master_requests_total{method=\"UpsertStart\"}") >= before + 80.0,
    );
    let results: Vec<Value> = [c1, c2].into_iter().map(Background::finish).collect();
    for r in &results {
        assert_eq!(result(r, "wrong"), 0, "never a wrong value: {r}");
        // Recovered: good rounds after its last failed one (a put that reached the old
        // leader may read back absent from the new one: allowed, never a wrong value).
        assert!(
            result(r, "ok_after_last_failure").as_u64().unwrap() >= 1,
            "{r}"
        );
        assert!(
            result(r, "slowest_failed_round_s").as_f64().unwrap() < slowest_failure_s,
            "failed calls return within {slowest_failure_s} s: {r}"
        );
    }
    let m = mg.metrics();
    assert_eq!(
        metric_value(
            &m,
            &format!("moongate_upstream_leader{{address=\"{old_rpc}\"}}")
        ),
        0.0
    );
    assert_eq!(metric_value(&m, "moongate_upstream_leader_present"), 1.0);
    // The first leader, its loss (the key expired), the new leader.
    assert_eq!(
        metric_value(&m, "moongate_upstream_leader_changes_total"),
        3.0,
        "{m}"
    );
    // No leaked connection: the two clients closed, nothing is left open.
    wait_for("connections closed", Duration::from_secs(10), &logs, || {
        mg.metric("moongate_master_connections_open") == 0.0
            && mg.metric("moongate_upstream_connections_open") == 0.0
    });
    eprintln!(
        "failover (signal {signal}): new leader serving {:?} after the signal; first calls \
         {:?} ago; client results {results:?}",
        new_serving,
        first_ok.elapsed()
    );
    if signal == libc::SIGSTOP {
        // Thawed, the old leader finds its lease gone and stands by; moongate stays.
        old.proc.signal(libc::SIGCONT);
        assert_eq!(
            mg.metric(&format!(
                "moongate_upstream_leader{{address=\"{new_rpc}\"}}"
            )),
            1.0
        );
    }
}
