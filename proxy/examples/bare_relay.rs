//! The floor for any sidecar hop: a byte relay with no framing, no decoding, no metrics,
//! on the same runtime flavour moongate uses. The end-to-end benchmark runs it beside
//! moongate so the cost of the hop itself and the cost of moongate's work are told apart.
//!
//! `cargo run --release --example bare_relay -- LISTEN UPSTREAM`

use tokio::net::{TcpListener, TcpStream};

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: bare_relay LISTEN_ADDR UPSTREAM_ADDR");
        std::process::exit(2);
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let l = TcpListener::bind(&listen).await?;
        loop {
            let (mut c, _) = l.accept().await?;
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(mut u) = TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = c.set_nodelay(true);
                let _ = u.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
            });
        }
    })
}
