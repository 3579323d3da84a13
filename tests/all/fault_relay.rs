//! A TCP relay that puts network faults between moongate and a master: pass, delay
//! every chunk, black hole (nothing gets through and nothing is lost: a partition TCP
//! would ride out by retransmitting), and reset (every open connection gets a RST on
//! both sides, as a middlebox dropping its state would).
//!
//! Plain threads and blocking sockets: it carries a few test connections, and what it
//! does to each byte must be obvious to a reader of a failing test.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// What the relay does to the bytes it carries from now on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Pass,
    /// Every chunk read waits this long before it is written on.
    Delay(Duration),
    /// Chunks are held (not dropped) until the mode changes back.
    BlackHole,
}

struct Link {
    /// Both sockets (clones), to reset them.
    ends: [TcpStream; 2],
    /// Set by a reset: the pumps leave without a FIN, so the last close sends the RST.
    reset: AtomicBool,
}

struct State {
    mode: Mutex<Fault>,
    changed: Condvar,
    links: Mutex<Vec<Arc<Link>>>,
    stop: AtomicBool,
    accepted: AtomicUsize,
}

impl State {
    fn mode(&self) -> MutexGuard<'_, Fault> {
        self.mode.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct FaultRelay {
    /// `host:port` to connect to instead of the target.
    pub addr: String,
    state: Arc<State>,
}

impl FaultRelay {
    /// Relays connections made to a free loopback port to `target`.
    pub fn start(target: &str) -> FaultRelay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let state = Arc::new(State {
            mode: Mutex::new(Fault::Pass),
            changed: Condvar::new(),
            links: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            accepted: AtomicUsize::new(0),
        });
        let st = state.clone();
        let target = target.to_string();
        std::thread::spawn(move || {
            for c in listener.incoming() {
                if st.stop.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = c else { continue };
                let Ok(server) = TcpStream::connect(&target) else {
                    continue; // the client sees its connection close
                };
                st.accepted.fetch_add(1, Ordering::Relaxed);
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let link = Arc::new(Link {
                    ends: [client.try_clone().unwrap(), server.try_clone().unwrap()],
                    reset: AtomicBool::new(false),
                });
                st.links.lock().unwrap().push(link.clone());
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let (st, link) = (st.clone(), link.clone());
                    std::thread::spawn(move || pump(from, to, &st, &link));
                }
            }
        });
        FaultRelay { addr, state }
    }

    pub fn set(&self, fault: Fault) {
        *self.state.mode() = fault;
        self.state.changed.notify_all();
    }

    /// Resets every connection open now: both sides get a RST.
    pub fn reset_all(&self) {
        let links: Vec<_> = std::mem::take(&mut *self.state.links.lock().unwrap());
        for l in &links {
            l.reset.store(true, Ordering::Relaxed);
            for s in &l.ends {
                set_linger_zero(s);
                // Wakes the pump blocked reading it; no FIN goes out for a read shutdown.
                let _ = s.shutdown(Shutdown::Read);
            }
        }
        self.state.changed.notify_all();
    }

    /// Connections relayed so far.
    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for FaultRelay {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        self.set(Fault::Pass);
        self.reset_all();
        let _ = TcpStream::connect(&self.addr); // wakes the accept loop
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, st: &State, link: &Link) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(n) if n > 0 && !link.reset.load(Ordering::Relaxed) => n,
            _ => break,
        };
        let delay = {
            let mut mode = st.mode();
            while *mode == Fault::BlackHole && !link.reset.load(Ordering::Relaxed) {
                mode = st.changed.wait(mode).unwrap_or_else(|p| p.into_inner());
            }
            match *mode {
                Fault::Delay(d) => d,
                _ => Duration::ZERO,
            }
        };
        std::thread::sleep(delay);
        if link.reset.load(Ordering::Relaxed) || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    if !link.reset.load(Ordering::Relaxed) {
        // An orderly end on one side is passed on as one.
        let _ = to.shutdown(Shutdown::Write);
    }
}

/// `SO_LINGER` 0: closing the socket sends a RST instead of a FIN.
fn set_linger_zero(s: &TcpStream) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on an open socket with a correctly sized `linger` value.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}
