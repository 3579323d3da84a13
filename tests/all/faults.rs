//! Network faults between moongate and a (single) real master, injected by
//! [`FaultRelay`], under verified put/get load from two real clients: a slow network,
//! connections reset on both sides, and a black hole. Each fault's behaviour is the one
//! `docs/operations.md` ("Faults between moongate and the master") writes down.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::fault_relay::{Fault, FaultRelay};
use crate::support::*;

const ANSWER_TIMEOUT_MS: u64 = 2000;

#[test]
fn moongate_rides_out_delay_reset_and_black_hole_between_it_and_the_master() {
    let master = Master::start();
    let relay = FaultRelay::start(&master.rpc);
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\nanswer_timeout_ms = {ANSWER_TIMEOUT_MS}\n",
        relay.addr
    ));
    mg.wait_ready(&master);
    let logs = [&master.proc, &mg.proc];
    let calls = || mg.metric("moongate_master_requests_total{method=\"UpsertStart\"}");
    let closed = |reason: &str| {
        mg.metric(&format!(
            "moongate_master_connections_closed_total{{reason=\"{reason}\"}}"
        ))
    };
    let ready = || http_get(&mg.admin, "/ready").is_some_and(|(s, _)| s == 200);
    let serving_again = |what: &str, n: f64| {
        let before = calls();
        wait_for(what, Duration::from_secs(60), &logs, || {
            calls() >= before + n
        });
    };
    let c1 = Background::start("failover", &mg.listen, &master.metadata, &logs);
    let c2 = Background::start("failover", &mg.listen, &master.metadata, &logs);
    serving_again("calls through the relay", 20.0);

    // Slow network: every chunk 100 ms late each way. Calls take longer and all
    // succeed; no connection is closed for it (the delay is under the answer timeout).
    relay.set(Fault::Delay(Duration::from_millis(100)));
    let silent_before = closed("upstream_silent");
    let t = Instant::now();
    serving_again("calls over a slow network", 10.0);
    let slow_per_call = t.elapsed() / 10;
    assert_eq!(closed("upstream_silent"), silent_before);
    assert_eq!(closed("upstream_error") + closed("upstream_closed"), 0.0);
    assert!(ready(), "a slow master is still ready");
    relay.set(Fault::Pass);

    // Reset: both sides get a RST. moongate closes each client connection whose
    // upstream died (the client's calls in flight fail at once), the clients reconnect
    // through moongate, and carry on.
    let relayed = relay.accepted();
    relay.reset_all();
    wait_for("resets seen", Duration::from_secs(10), &logs, || {
        closed("upstream_error") + closed("upstream_closed") >= 2.0
    });
    serving_again("calls after the reset", 20.0);
    assert!(relay.accepted() > relayed, "the clients reconnected");

    // Black hole: nothing gets through either way. Calls in flight wait the answer
    // timeout, then moongate closes their connections; /ready turns 503 (its probe
    // times out); when the network heals, the clients carry on.
    relay.set(Fault::BlackHole);
    let holed = Instant::now();
    wait_for(
        "silent upstream noticed",
        Duration::from_secs(10),
        &logs,
        || closed("upstream_silent") >= 1.0,
    );
    let noticed = holed.elapsed();
    wait_for(
        "not ready in the black hole",
        Duration::from_secs(10),
        &logs,
        || !ready(),
    );
    relay.set(Fault::Pass);
    wait_for("ready again", Duration::from_secs(10), &logs, ready);
    serving_again("calls after the black hole", 20.0);

    let results: Vec<Value> = [c1, c2].into_iter().map(Background::finish).collect();
    // A round is a put and a get; each waits at most the answer timeout (+ its check
    // interval) before its connection is closed.
    assert_recovered(
        &results,
        2.0 * 1.2 * ANSWER_TIMEOUT_MS as f64 / 1000.0 + 1.0,
    );
    wait_no_connections(&mg, &logs);
    eprintln!(
        "faults: {slow_per_call:?} per call under 100 ms delay; black hole noticed after \
         {noticed:?}; closes: {}; clients {results:?}",
        mg.metrics()
            .lines()
            .filter(|l| l.starts_with("moongate_master_connections_closed_total"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
