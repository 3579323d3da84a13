//! Two moongates move values over QUIC: B owns the only segment and serves it over QUIC
//! as well as TE-TCP, A's kv face writes and reads it over QUIC; an unmodified Python
//! client reads and writes the same segment over TE-TCP; a peer whose QUIC identity does
//! not check out is reached over TE-TCP instead.

mod support;

use support::*;

fn enc(key: &str) -> String {
    format!("/v1/kv/{}", key.replace('/', "%2F"))
}

#[test]
fn two_moongates_move_values_over_quic_and_fall_back_to_tcp() {
    let master = Master::start();
    let (b, _b_kv) = kv_moongate(
        &master,
        "segment_bytes = 67108864\nquic_listen = \"127.0.0.1:0\"\n",
    );
    let name = wait_segment_mounted(&b);
    assert!(b.proc.log_text().contains("own segment served over QUIC"));
    let (a, a_kv) = kv_moongate(&master, "");
    let logs = [&master.proc, &a.proc, &b.proc];
    let all = || {
        logs.iter()
            .map(|p| p.log_text())
            .collect::<Vec<_>>()
            .join("\n")
    };

    // A -> B over QUIC (B's segment is the only one)
    for (key, size) in [("own/small", 5000), ("own/big", (3 << 20) + 7)] {
        let (st, m) = http(&a_kv, "PUT", &enc(key), &value_of(key, size)).unwrap();
        assert_eq!(st, 201, "{m}\n{}", all());
    }
    let (st, body) = http_bytes(&a_kv, "GET", &enc("own/big"), &[]).unwrap();
    assert!(
        st == 200 && body == value_of("own/big", (3 << 20) + 7),
        "{st}"
    );

    // An unmodified client with no memory reads and writes B's segment over TE-TCP.
    let r = run_role("guest", &master.rpc, &master.metadata, &[], &logs);
    let ops = r.as_array().unwrap();
    let get = |n: &str| ops.iter().find(|o| o[0] == n).unwrap()[1].clone();
    assert_eq!(get("get own/small")["ok"], true, "{r}");
    assert_eq!(get("get own/big")["ok"], true, "{r}");
    assert_eq!(get("put py/big"), 0, "{r}");
    // ... and A reads what it wrote, over QUIC.
    let (st, body) = http_bytes(&a_kv, "GET", &enc("py/big"), &[]).unwrap();
    assert!(
        st == 200 && body == value_of("py/big", (5 << 20) + 1),
        "{st}"
    );

    let m = a.metrics();
    let t = |transport: &str, dir: &str| {
        metric_value(
            &m,
            &format!(
                "moongate_kv_transfers_total{{transport=\"{transport}\",direction=\"{dir}\"}}"
            ),
        )
    };
    assert_eq!((t("quic", "write"), t("quic", "read")), (2.0, 2.0), "{m}");
    assert_eq!((t("tcp", "write"), t("tcp", "read")), (0.0, 0.0), "{m}");
    assert!(
        a.proc
            .log_text()
            .contains("quic connection to a peer moongate")
    );

    // C does not trust B's QUIC identity (a forged fingerprint in the metadata server):
    // it falls back to TE-TCP and still reads bit-exact.
    let md = master
        .metadata
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let quic_key = format!(
        "/metadata?key=moongate%2Fquic%2F{}",
        name.replace(':', "%3A")
    );
    let (_, entry) = http_get(&md, &quic_key).unwrap();
    let forged = entry.replace(
        &entry[entry.find("\"sha256\":\"").unwrap() + 10..][..64],
        &"0".repeat(64),
    );
    let (st, _) = http(&md, "PUT", &quic_key, forged.as_bytes()).unwrap();
    assert_eq!(st, 200);
    let (c, c_kv) = kv_moongate(&master, "");
    let (st, body) = http_bytes(&c_kv, "GET", &enc("own/small"), &[]).unwrap();
    assert!(
        st == 200 && body == value_of("own/small", 5000),
        "{st}\n{}",
        c.proc.log_text()
    );
    let mc = c.metrics();
    assert_eq!(
        metric_value(
            &mc,
            "moongate_kv_transfers_total{transport=\"tcp\",direction=\"read\"}"
        ),
        1.0,
        "{mc}"
    );
    assert!(c.proc.log_text().contains("falling back to TE-TCP"));
}
